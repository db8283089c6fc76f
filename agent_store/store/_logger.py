"""AgentMessageLogger: persists turns, each in at most two round trips, idempotently.

Write path of one turn:
1. Reserve: one `find_one_and_update` (an update pipeline, upserting) on the
   conversation document adds the turn's message count to `message_count`,
   records the turn id in `recent_turns` and updates every summary field. Its
   filter excludes conversations that already record this turn id, so a retry
   cannot reserve twice: the upsert then collides with the existing `_id`.
2. Insert: one unordered `insert_many` of the messages with `seq` values from
   the reserved block. Messages a crashed attempt already stored collide on
   their stable `_id`; those duplicate-key errors are the only ones swallowed.

A retry after a crash between the two writes finds its turn recorded, reads
the conversation once to learn the reserved block, and inserts what is missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict
from pymongo import ReturnDocument
from pymongo.errors import BulkWriteError, DuplicateKeyError

from agent_store.core import (
    AgentMessage,
    Conflict,
    Conversation,
    NotFound,
    StorageFailure,
    message_adapter,
    utc_now,
)
from agent_store.store._driver import DUPLICATE_KEY, Database, storage_errors
from agent_store.store._indexes import CONVERSATIONS, MESSAGES, IndexSetup
from agent_store.store._text import clean_name
from agent_store.store._turns import (
    PENDING_CALLS_KEPT,
    KeepPendingHitl,
    TurnPlan,
    TurnRules,
    plan_turn,
    validate_identifier,
)

_RESERVE_ATTEMPTS = 3


def literal(value: Any) -> dict[str, Any]:
    """A constant inside an update pipeline: strings starting with `$` stay strings."""
    return {"$literal": value}


class LoggedTurn(BaseModel):
    """What `log_messages` stored."""

    model_config = ConfigDict(frozen=True)

    conversation_id: str
    turn_id: str
    messages: list[AgentMessage]
    """The stored messages, with `_id` and `seq`."""
    replayed: bool
    """True when the turn had been reserved before: this call was a retry."""


class TurnObserver(Protocol):
    """Told of every logged turn, after its messages are stored (e.g. the legacy dual write)."""

    async def turn_logged(self, turn: LoggedTurn, conversation: Conversation) -> None:
        """Record the turn elsewhere; a retried turn must rewrite the same record."""
        ...


class AgentMessageLogger:
    """Logs agent turns into `agent_messages` and `agent_conversations`.

    Takes a PyMongo `AsyncDatabase` or a Motor database; it never opens a
    connection nor reads the environment itself.
    """

    def __init__(
        self,
        db: Database,
        *,
        rules: TurnRules | None = None,
        observers: Sequence[TurnObserver] = (),
    ) -> None:
        """Log into `db`. `observers` are told of each stored turn (e.g. the legacy dual write,
        which costs a third round trip per turn while it is on)."""
        self.rules = rules or TurnRules()
        self._messages = db[MESSAGES]
        self._conversations = db[CONVERSATIONS]
        self._indexes = IndexSetup(db)
        self._observers = tuple(observers)

    async def ensure_indexes(self) -> None:
        """Create the store's indexes (idempotent; retried after a failure)."""
        await self._indexes.ensure()

    async def upsert_conversation(
        self, conversation_id: str, *, user_id: str | None = None, name: str | None = None
    ) -> Conversation:
        """Create a conversation if it is missing; set its name when one is given.

        A name given here is a person's or runtime's choice and always wins over
        an automatic one. A conversation that already belongs to another user is
        left as it is and raises Conflict: ownership moves only by `claim`.
        """
        conversation_id = validate_identifier(conversation_id, "conversation_id")
        if user_id is not None:
            user_id = validate_identifier(user_id, "user_id")
        now = utc_now()
        update: dict[str, Any] = {
            "$setOnInsert": {
                "conversation_id": conversation_id,
                "created_at": now,
                "updated_at": now,
                "turn_count": 0,
                "last_message_preview": "",
                "message_count": 0,
                "pending_hitl": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
                "recent_turns": [],
            },
            "$set": {"user_id": user_id} if user_id is not None else {},
        }
        if name is not None:
            update["$set"] |= {"name": clean_name(name), "name_source": "set"}
        else:
            update["$setOnInsert"] |= {"name": None, "name_source": None}
        if not update["$set"]:
            del update["$set"]
        if user_id is None:
            update["$setOnInsert"]["user_id"] = None
        owner_filter = {"user_id": {"$in": [None, user_id]}} if user_id is not None else {}
        with storage_errors("upsert the conversation"):
            try:
                doc = await self._conversations.find_one_and_update(
                    {"_id": conversation_id, **owner_filter},
                    update,
                    upsert=True,
                    return_document=ReturnDocument.AFTER,
                )
            except DuplicateKeyError as exc:
                raise Conflict(
                    f"conversation {conversation_id!r} belongs to another user; "
                    "use claim to move it"
                ) from exc
        return Conversation.model_validate(doc)

    async def log_message(
        self,
        conversation_id: str,
        message: AgentMessage | Mapping[str, Any],
        *,
        user_id: str | None = None,
        turn_id: str | None = None,
    ) -> AgentMessage:
        """Log one message as a turn of its own; returns it as stored."""
        logged = await self.log_messages(
            conversation_id, [message], user_id=user_id, turn_id=turn_id
        )
        return logged.messages[0]

    async def log_messages(
        self,
        conversation_id: str,
        messages: Sequence[AgentMessage | Mapping[str, Any]],
        *,
        user_id: str | None = None,
        turn_id: str | None = None,
        name: str | None = None,
        owner_only: bool = False,
    ) -> LoggedTurn:
        """Log one turn's messages in order, idempotently by `turn_id`.

        `turn_id` defaults to a digest of the messages (content and timestamps),
        so retrying the same call is safe even without one. `name` is a name the
        runtime generated; it replaces an automatic name or an earlier runtime
        name, never one a person set. With `owner_only`, a conversation owned by
        someone other than `user_id` is treated as missing (the API uses this for
        user tokens).
        Raises InvalidInput, writing nothing, when the turn breaks the contract.
        """
        plan = plan_turn(conversation_id, messages, turn_id=turn_id, rules=self.rules)
        if user_id is not None:
            user_id = validate_identifier(user_id, "user_id")
        runtime_name = clean_name(name) if name is not None else None
        conversation, replayed = await self._reserve(plan, user_id, runtime_name, owner_only)
        first_seq = conversation.first_seq_of(plan.turn_id)
        assert first_seq is not None
        stored = [
            message.model_copy(update={"seq": first_seq + index, "user_id": conversation.user_id})
            for index, message in enumerate(plan.messages)
        ]
        stored = await self._insert(stored)
        logged = LoggedTurn(
            conversation_id=plan.conversation_id,
            turn_id=plan.turn_id,
            messages=stored,
            replayed=replayed,
        )
        for observer in self._observers:
            await observer.turn_logged(logged, conversation)
        return logged

    async def _reserve(
        self, plan: TurnPlan, user_id: str | None, name: str | None, owner_only: bool
    ) -> tuple[Conversation, bool]:
        """Reserve the turn's `seq` block, or find the block an earlier attempt reserved."""
        count = len(plan.messages)
        query: dict[str, Any] = {
            "_id": plan.conversation_id,
            "recent_turns.turn_id": {"$ne": plan.turn_id},
        }
        if owner_only:
            query["user_id"] = {"$in": [None, user_id]}
        for _ in range(_RESERVE_ATTEMPTS):
            with storage_errors("reserve the turn"):
                try:
                    doc = await self._conversations.find_one_and_update(
                        query,
                        [{"$set": _reservation(plan, user_id, name, self.rules)}],
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                    return Conversation.model_validate(doc), False
                except DuplicateKeyError:
                    doc = await self._conversations.find_one({"_id": plan.conversation_id})
            if doc is None:
                continue  # deleted meanwhile: reserve again
            conversation = Conversation.model_validate(doc)
            if owner_only and conversation.user_id not in (None, user_id):
                raise NotFound(f"conversation {plan.conversation_id!r} was not found")
            recorded = next(
                (r for r in conversation.recent_turns if r.turn_id == plan.turn_id), None
            )
            if recorded is None:
                continue  # lost a race to create the conversation: reserve again
            if recorded.count != count:
                raise Conflict(
                    f"turn {plan.turn_id!r} was logged with {recorded.count} messages; "
                    f"this call has {count}. Use a new turn_id for a new turn"
                )
            return conversation, True
        raise StorageFailure(
            f"could not reserve turn {plan.turn_id!r} after {_RESERVE_ATTEMPTS} attempts"
        )

    async def _insert(self, messages: list[AgentMessage]) -> list[AgentMessage]:
        """Insert the messages; returns them as stored, an earlier attempt's copy where one was."""
        documents = [m.model_dump(by_alias=True) for m in messages]
        with storage_errors("insert the messages"):
            try:
                await self._messages.insert_many(documents, ordered=False)
            except BulkWriteError as exc:
                earlier = await self._accept_only_own_duplicates(exc, documents)
                return [earlier.get(m.id or "", m) for m in messages]
        return messages

    async def _accept_only_own_duplicates(
        self, error: BulkWriteError, documents: list[dict[str, Any]]
    ) -> dict[str, AgentMessage]:
        """Swallow duplicate-key errors of messages already stored by an earlier attempt.

        Returns those messages as the earlier attempt stored them, by id.
        """
        write_errors = error.details.get("writeErrors", [])
        if any(e.get("code") != DUPLICATE_KEY for e in write_errors):
            raise error
        failed = {documents[e["index"]]["_id"]: documents[e["index"]] for e in write_errors}
        # The conversation id keeps this lookup on one shard of a sharded cluster.
        conversation_id = documents[0]["conversation_id"]
        stored = {
            doc["_id"]: doc
            async for doc in self._messages.find(
                {"conversation_id": conversation_id, "_id": {"$in": list(failed)}}
            )
        }
        for message_id, wanted in failed.items():
            found = stored.get(message_id)
            if found is None or (found["conversation_id"], found["seq"]) != (
                wanted["conversation_id"],
                wanted["seq"],
            ):
                raise Conflict(
                    f"message id {message_id!r} or seq {wanted['seq']} of conversation "
                    f"{wanted['conversation_id']!r} is already taken by another message"
                )
        return {i: message_adapter.validate_python(doc) for i, doc in stored.items()}


def _reservation(
    plan: TurnPlan, user_id: str | None, runtime_name: str | None, rules: TurnRules
) -> dict[str, Any]:
    """The `$set` stage that records one turn on its conversation document."""

    def plus(field: str, amount: int) -> dict[str, Any]:
        return {"$add": [{"$ifNull": [f"${field}", 0]}, amount]}

    def kept(field: str, default: Any) -> dict[str, Any]:
        return {"$ifNull": [f"${field}", literal(default)]}

    name_is_unset = {"$eq": [kept("name", None), None]}
    stage: dict[str, Any] = {
        "conversation_id": literal(plan.conversation_id),
        "user_id": kept("user_id", user_id),
        "created_at": kept("created_at", plan.messages[0].created_at),
        "updated_at": {"$max": ["$updated_at", literal(plan.updated_at)]},
        "turn_count": plus("turn_count", plan.turn_starts),
        "message_count": plus("message_count", len(plan.messages)),
        "usage.input_tokens": plus("usage.input_tokens", plan.usage.input_tokens),
        "usage.output_tokens": plus("usage.output_tokens", plan.usage.output_tokens),
        "recent_turns": {
            "$slice": [
                {
                    "$concatArrays": [
                        kept("recent_turns", []),
                        literal([{"turn_id": plan.turn_id, "count": len(plan.messages)}]),
                    ]
                },
                -rules.recent_turns_kept,
            ]
        },
        "last_message_preview": (
            literal(plan.preview) if plan.preview is not None else kept("last_message_preview", "")
        ),
        **_pending_state(plan),
    }
    if runtime_name is not None:
        replaceable = {
            "$or": [
                name_is_unset,
                {"$eq": ["$name_source", "auto"]},
                {"$eq": ["$name_source", "runtime"]},
            ]
        }
        stage["name"] = {"$cond": [replaceable, literal(runtime_name), "$name"]}
        stage["name_source"] = {"$cond": [replaceable, "runtime", "$name_source"]}
    elif plan.auto_name is not None:
        stage["name"] = {"$cond": [name_is_unset, literal(plan.auto_name), "$name"]}
        stage["name_source"] = {"$cond": [name_is_unset, "auto", "$name_source"]}
    else:
        stage["name"] = kept("name", None)
        stage["name_source"] = kept("name_source", None)
    return stage


def _pending_state(plan: TurnPlan) -> dict[str, Any]:
    """`pending_calls` and `pending_hitl` after the turn, in the reservation's `$set` stage.

    Calls the turn answers leave `pending_calls` and the calls it leaves open
    join it (the newest `PENDING_CALLS_KEPT` are kept). A prompt stays
    pending unless the turn raises a new one, clears it (an upload), or
    answers a call the prompt held back.
    """
    calls: Any = {"$ifNull": ["$pending_calls", literal([])]}
    hitl: Any = {"$ifNull": ["$pending_hitl", None]}
    if not isinstance(plan.pending_hitl, KeepPendingHitl):
        hitl = literal(plan.pending_hitl and plan.pending_hitl.model_dump())
    if not plan.answered_calls and not plan.opened_calls:
        return {"pending_calls": calls, "pending_hitl": hitl}

    def answered(wanted: bool) -> dict[str, Any]:
        is_answered = {"$in": ["$$call.tool_call_id", literal(list(plan.answered_calls))]}
        # `$eq` to a boolean rather than `$not`, which mongomock evaluates wrongly.
        return {"$filter": {"input": calls, "as": "call", "cond": {"$eq": [is_answered, wanted]}}}

    if isinstance(plan.pending_hitl, KeepPendingHitl) and plan.answered_calls:
        held = {"$map": {"input": answered(True), "as": "call", "in": "$$call.request_id"}}
        hitl = {
            "$cond": [{"$in": [{"$ifNull": ["$pending_hitl.request_id", None]}, held]}, None, hitl]
        }
    opened = literal([call.model_dump() for call in plan.opened_calls])
    kept = {"$slice": [{"$concatArrays": [answered(False), opened]}, -PENDING_CALLS_KEPT]}
    return {"pending_calls": kept, "pending_hitl": hitl}
