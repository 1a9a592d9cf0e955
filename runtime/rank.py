"""A follower rank of a distributed model: ``python -m runtime.rank SPEC_JSON``.

``flow serve`` starts one per rank above 0 (``flow.resources.cluster``) with ``MLX_RANK`` and ``MLX_HOSTFILE`` in its
environment (``mlx.launch``'s conventions). It joins the group, checks it, loads its shard and replays rank 0's
engine steps (:func:`runtime.distributed.follow`). Exit status: 0 when rank 0 stopped the group, 2 when the
group was refused (versions or model differ), 1 when it was lost.
"""

from __future__ import annotations

import logging
import os
import sys

from runtime.device import DeviceThread
from runtime.distributed import RankSpec, follow
from runtime.replication import GroupLost


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if len(argv) != 1:
        print("usage: python -m runtime.rank SPEC_JSON", file=sys.stderr)
        return 2
    spec = RankSpec.of_json(argv[0])
    device = DeviceThread("flow-rank-device")
    try:
        device.call(lambda: follow(spec, device))
    except GroupLost as exc:
        logging.getLogger("flow.distributed").error("%s", exc)
        return 2
    except Exception as exc:  # the ring backend's "connection to a peer was lost", a failed load
        logging.getLogger("flow.distributed").error("the group is lost: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # without waiting for MLX's ring threads to wind down
