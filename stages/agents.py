"""The agents API: stateful conversations the server keeps (``agent_store`` resource).

``agents.manage`` answers the CRUD routes by itself (it is their entry and exit
stage, like ``openai.responses.retrieve``)::

    POST   /v1/agents                 create: id, model, system_prompt, max_context, context_overflow, persist
    GET    /v1/agents                 list
    GET    /v1/agents/{agent_id}      one agent with its history and KV status (hot / warm / cold)
    PATCH  /v1/agents/{agent_id}      change model, system_prompt, max_context, context_overflow, persist
    DELETE /v1/agents/{agent_id}

``POST /v1/agents/{agent_id}/generate`` runs the shared inference path between
``agents.generate.decode`` and ``agents.generate.format``. The body is an OpenAI
chat-completions body holding only the turn's new messages (``model`` optional:
a per-request override). The decode stage puts the agent's system prompt and
history in front of them, names the prefix-cache session ``agent:ID`` and
passes on the agent's context cap and overflow policy; the format stage answers
in the chat-completion shape (JSON or SSE chunks) and, when the answer is
complete, appends the turn to the history.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import trio
from pydantic import BaseModel, ConfigDict, Field

from flow.graph.resource import Reference
from flow.graph.stage import StageConfig, on_request_end
from flow.resources.agent_store import AGENT_ID, AGENT_ID_RULE, Agent, AgentStore, session_id
from protocols import openai_chat
from protocols.errors import ApiError
from protocols.ir import ChatRequest, ContextOverflow, FinalResult, HttpRequest, Message, ProtocolContext
from protocols.validation import parse_json_body
from stages.protocol import EndpointStage, FormatConfig, ProtocolDecode, ProtocolFormat, decode_on_worker


@dataclass(frozen=True)
class AgentTurnContext(ProtocolContext):
    """What ``agents.generate.format`` reads back: whose turn it is, and the turn's new messages (the
    request's messages also hold the system prompt and the history)."""

    agent_id: str
    new_messages: tuple[dict[str, Any], ...]


class AgentStageConfig(StageConfig):
    store: str | None = None  # the agent_store resource (default: the graph's only one)


class AgentFormatConfig(FormatConfig):
    store: str | None = None


STORE_REFERENCES = {"store": Reference("agent_store")}


def _not_found(agent_id: str) -> ApiError:
    return ApiError("not_found", f"No agent with id '{agent_id}'; GET /v1/agents lists them (agents created with "
                    "persist=false do not survive a restart).", param="agent_id", code="agent_not_found")


# --------------------------------------------------------------------------- bodies


MAX_CONTEXT = 2**31 - 1  # a context cap beyond any model's; larger ones overflow SQLite's INTEGER (a 500)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AgentCreateBody(_Strict):
    id: str | None = Field(default=None, pattern=AGENT_ID.pattern, description=AGENT_ID_RULE)
    model: str = Field(min_length=1)
    system_prompt: str = ""
    max_context: int | None = Field(default=None, ge=16, le=MAX_CONTEXT)
    context_overflow: ContextOverflow | None = None
    persist: bool = True


class AgentPatchBody(_Strict):
    model: str | None = Field(default=None, min_length=1)
    system_prompt: str | None = None
    max_context: int | None = Field(default=None, ge=16, le=MAX_CONTEXT)
    context_overflow: ContextOverflow | None = None
    persist: bool | None = None


class AgentGenerateBody(openai_chat.ChatCompletionBody):
    """A chat-completions body of new messages; ``model`` overrides the agent's for this turn only."""

    model: str | None = Field(default=None, min_length=1)  # type: ignore[assignment]


def agent_json(agent: Agent, status: str, overflow: ContextOverflow, busy: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": agent.id,
        "object": "agent",
        "model": agent.model,
        "system_prompt": agent.system_prompt,
        "max_context": agent.max_context,
        "context_overflow": overflow,
        "persist": agent.persist,
        "status": status,
        "busy": busy,  # answering a turn now
        "context_tokens": agent.context_tokens,
        "messages": agent.messages,
        "created_at": int(agent.created),
        "last_access": int(agent.last_access),
    }
    if agent.history is not None:
        out["history"] = list(agent.history)
    return out


# --------------------------------------------------------------------------- CRUD


class AgentsManage(EndpointStage):
    type_name: ClassVar[str] = "agents.manage"
    description = ("agents API: POST/GET /v1/agents, GET/PATCH/DELETE /v1/agents/{agent_id} "
                   "(route parameter: agent_id)")
    Config = AgentStageConfig
    references = STORE_REFERENCES

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", AgentStore)

    codec = openai_chat.ChatCodec

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        return await trio.to_thread.run_sync(self._answer, http)  # SQLite: off the event loop

    def _json(self, agent: Agent) -> dict[str, Any]:
        return agent_json(agent, self.store.status(agent), self.store.overflow(agent), self.store.busy(agent.id))

    def _answer(self, http: HttpRequest) -> dict[str, Any]:
        agent_id = dict(http.params).get("agent_id")
        if agent_id is None:
            if http.method == "POST":
                return self._create(http)
            if http.method == "GET":
                return {"object": "list", "data": [self._json(a) for a in self.store.agents()]}
        elif http.method == "GET":
            agent = self.store.get(agent_id, history=True)
            if agent is None:
                raise _not_found(agent_id)
            return self._json(agent)
        elif http.method == "PATCH":
            return self._patch(agent_id, http)
        elif http.method == "DELETE":
            if not self.store.delete(agent_id):
                raise _not_found(agent_id)
            return {"id": agent_id, "object": "agent.deleted", "deleted": True}
        raise ApiError("method_not_allowed", f"{http.method} is not allowed on {http.path}.")

    def _create(self, http: HttpRequest) -> dict[str, Any]:
        body = parse_json_body(AgentCreateBody, http.body)
        agent = self.store.create(body.id or f"agent_{http.request_id}", self.store.model_name(body.model),
                                  body.system_prompt, body.max_context, body.context_overflow, body.persist)
        return self._json(agent)

    def _patch(self, agent_id: str, http: HttpRequest) -> dict[str, Any]:
        body = parse_json_body(AgentPatchBody, http.body)
        changes = {name: getattr(body, name) for name in body.model_fields_set}
        for name in ("model", "system_prompt", "persist"):  # may be changed, not cleared
            if name in changes and changes[name] is None:
                raise ApiError("invalid_request", f"'{name}' cannot be null.", param=name)
        if changes.get("model") is not None:
            changes["model"] = self.store.model_name(changes["model"])
        agent = self.store.update(agent_id, changes)
        if agent is None:
            raise _not_found(agent_id)
        return self._json(agent)


# --------------------------------------------------------------------------- generate


class AgentsGenerateDecode(ProtocolDecode):
    type_name: ClassVar[str] = "agents.generate.decode"
    description = ("an agent's turn: its system prompt and history, then the body's new messages (OpenAI chat "
                   "body), as a chat request in the agent's prefix-cache session")
    context_type = AgentTurnContext
    Config = AgentStageConfig
    references = STORE_REFERENCES

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", AgentStore)

    async def decode_request(self, http: HttpRequest) -> ChatRequest:
        # reading a long history is file IO: off the event loop
        return await decode_on_worker(self.decode, http, int(time.time()))

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        agent_id = http.param("agent_id")
        # One turn at a time: claim the agent before reading its history, so that no turn is answered on a
        # history another turn is about to extend; released when this request ends, however it ends.
        on_request_end(lambda: self.store.end_turn(agent_id, http.request_id))
        self.store.begin_turn(agent_id, http.request_id)
        agent = self.store.get(agent_id, history=True)
        if agent is None:
            raise _not_found(agent_id)
        body = parse_json_body(AgentGenerateBody, http.body)
        if body.n != 1:
            raise ApiError("invalid_request", f"'n' must be 1 (got {body.n}): an agent's turn adds one answer to "
                           "its history.", param="n")
        model = agent.model if body.model is None else self.store.model_name(body.model)
        request = openai_chat.decode_chat_body(body.model_copy(update={"model": model}), http.request_id, created)
        system = (Message("system", agent.system_prompt),) if agent.system_prompt else ()
        history = tuple(Message.from_template(m) for m in agent.history or ())
        return replace(
            request,
            messages=(*system, *history, *request.messages),
            cache=replace(request.cache, session_id=session_id(agent.id)),
            max_context=agent.max_context,
            context_overflow=self.store.overflow(agent),
            context=AgentTurnContext(agent.id, tuple(m.to_template() for m in request.messages)),
        )


class AgentsGenerateFormat(ProtocolFormat):
    type_name: ClassVar[str] = "agents.generate.format"
    description = "answers an agent's turn as chat.completion JSON or chunk SSE; appends the turn to its history"
    codec = openai_chat.ChatCodec
    reads_context = AgentTurnContext
    Config = AgentFormatConfig
    references = STORE_REFERENCES

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", AgentStore)

    async def finished(self, result: FinalResult, body: dict[str, Any]) -> None:
        request = result.request
        context = request.context_as(AgentTurnContext)
        turn = [*context.new_messages, openai_chat.assistant_message(result).to_template()]
        agent_id = context.agent_id
        await trio.to_thread.run_sync(lambda: self.store.append_turn(
            agent_id, turn, context_tokens=result.usage.total_tokens, model=request.model))
        # Free for the next turn now that the history has this one: a client may follow up as soon as it has
        # the response, before the request has wound down.
        self.store.end_turn(agent_id, request.request_id)
