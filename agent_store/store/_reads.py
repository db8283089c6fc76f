"""ConversationStore: the read paths and the admin operations on stored conversations.

Every read is a plain `find` on an index, sorted by the index: no aggregation
and no reordering at read time. Calls that take `user_id` as a scope only see
(and only change) that user's conversations.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict
from pymongo import ReturnDocument

from agent_store.core import (
    AgentMessage,
    Conflict,
    Conversation,
    ConversationPage,
    Count,
    InvalidInput,
    MessagePage,
    NotFound,
    PendingCall,
    PendingHitl,
    PoppedMessage,
    PromptNotPending,
    StorageUnavailable,
    Truncation,
    VersionMismatch,
    awaiting_results,
    calls_answered,
    conversation_version,
    epoch_millis,
    from_epoch_millis,
    listed,
    message_adapter,
    messages_adapter,
    shown,
    to_utc_millis,
    utc_now,
)
from agent_store.store._blobs import FullTextStore, parts_by_whole_text
from agent_store.store._deletions import DeletionRecords, recorded_as, refuse_unless_found_standing
from agent_store.store._driver import Database, async_database, pause, storage_errors
from agent_store.store._fork import approvals_withdrawn, fork_turns_of
from agent_store.store._indexes import (
    CONVERSATIONS,
    LANGGRAPH_CHECKPOINTS,
    LIFE_READ,
    MESSAGES,
    THREAD_COLLECTIONS,
    thread_of,
)
from agent_store.store._legacy_seam import FallbackConversation, LegacySource, not_migrated_yet
from agent_store.store._pop import (
    POPS_READ,
    Pop,
    PopMemory,
    Refusal,
    finish_marked,
    popped_since_read,
)
from agent_store.store._relocated import looked_again, settle, stored_among
from agent_store.store._reservation import (
    CONVERSATION_DOCUMENT,
    DELETING,
    LISTED,
    MIGRATING,
    NONE_RELISTED,
    NOT_BEING_DELETED,
    PENDING_BLOCKS,
    REFOLD_OWED,
    RELISTED,
    STANDING,
    SUMMARY,
    UNSTANDING_READ,
    CallKey,
    answered_before,
    concerned_calls,
    conversation_by_id,
    is_listed,
    is_standing,
    life_named,
    of_epoch,
    refuse_unless_fallback_serves,
    refuse_unless_standing,
    relisted_held,
    resolution,
    same_as_read,
    same_conversation,
    seen_by_caller,
    watched_blocks,
    with_none_of,
)
from agent_store.store._tail import LEFT_BEFORE_READ, LeftBefore, settled
from agent_store.store._text import clean_name, collapse_whitespace, search_words
from agent_store.store._truncation import NATIVE
from agent_store.store._turns import (
    GAPS_READ,
    Gaps,
    TurnRules,
    answered_in,
    folded_after,
    is_fork_turn,
    seems_cut,
    turn_key,
    validate_identifier,
    whole_prompt,
)
from agent_store.store._values import storable

_First = TypeVar("_First")
_Second = TypeVar("_Second")

MAX_PAGE_SIZE = 200
PAGE_BYTES = 4 * 1024 * 1024
"""About how much a page of conversations, messages, search hits or steering deliveries holds
at most (`_approximate_size`: its text, that of its keys too, one per character, plus a
little per value): a page ends before the item that would take it past this, but holds one
at least, so a page may hold fewer items than its `limit` (`has_more` then says to read on).
What a request reads and serves stays about this whatever its `limit`; served as JSON, a
control character takes six bytes (`\\u0001`), so an answer is at most about six times
this."""
PAGE_FIRST_BATCH = 21
"""The first read of a page holds at most this many documents: a page of the default 20 and
the one telling whether more follow in one round trip, and a reply the server can send (the
embedded server sends a batch whole: 21 messages of 1 MiB are well under its 48 MB)."""
# Messages in the first reply of a transcript read: a 300-message transcript is one round
# trip. Longer ones continue in further batches (never cut); the server caps each at 16 MiB.
TRANSCRIPT_BATCH = 10_000
# Streamed transcripts: the first batch is short (its messages' sizes are unknown), the
# next ones hold about STREAM_BATCH_BYTES of the largest message seen, at most STREAM_BATCH.
FULL_TEXT_PART_CHARS = 16 * 1024 * 1024
"""How many characters of whole texts a streamed transcript or export with `full` puts back
at once (one message's at least)."""
STREAM_FIRST_BATCH = 32
STREAM_BATCH = 1000
STREAM_BATCH_BYTES = 1_048_576
MAX_SEARCH_QUERY_CHARS = 500
# Conversation ids per command of a claim's message moves: each command stays small however
# many conversations the account has.
CLAIM_CHUNK = 1000
SortOrder = Literal["asc", "desc"]


class SearchHit(BaseModel):
    """One message that matched a search, with its relevance."""

    model_config = ConfigDict(frozen=True)

    message: AgentMessage
    rank: Count
    """1 for the best match."""


class SearchPage(BaseModel):
    """A page of search hits, best first."""

    model_config = ConfigDict(frozen=True)

    data: list[SearchHit]
    has_more: bool
    """More hits follow: the page ended at `limit`, or before the hit that would take it
    past `PAGE_BYTES`."""
    next_cursor: str | None = None
    """Pass as `cursor` to read the next page; null on the last page."""


class Deleted(BaseModel):
    """How many documents a delete or an erase removed."""

    conversations: Count
    messages: Count
    legacy_turns: Count = 0
    """Legacy turn documents removed too, so a migration or a rollback cannot bring them back."""


class Claimed(BaseModel):
    """How many documents a claim moved to the new owner."""

    conversations: Count
    messages: Count
    legacy_turns: Count = 0


class ConversationExport(BaseModel):
    """One conversation with its whole transcript."""

    conversation: Conversation
    messages: list[AgentMessage]


@dataclass(frozen=True)
class ExportStream:
    """One conversation of a user's export, its messages streamed (`stream_user_exports`):
    the summary holds for every message `first` and `rest` serve."""

    conversation: Conversation
    """The conversation as it counts the messages that follow (listed, or read again after a
    pop since)."""
    first: list[AgentMessage]
    """Its first batch of messages, read before the summary was paired with them."""
    rest: AsyncGenerator[list[AgentMessage], None]
    """Its other batches (`stream_transcript(life=conversation)`): Conflict after the last one
    when the conversation changed so that what was served is not what it counts."""


EXPORT_READS = 3
"""How many times an export reads a conversation that pops keep changing (each read after the
last pop, its messages with it) before it gives up: Conflict; or one holding a turn still being
written (its block reserved and counted, its messages not stored yet): StorageUnavailable."""

EXPORT_WAIT = 0.05
"""Seconds an export waits before it reads again a conversation holding a turn still being
written, doubled at each read: a turn's insert follows its reservation at once."""

EXPORT_LOOKUP: dict[str, Any] = {"inbox": 0, "runtime_turns": 0}
"""What an export's lookup of a conversation reads: its summary with its turn records
(`Gaps`), to tell a turn counted and not stored yet."""


def _page_size(limit: int) -> int:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise InvalidInput(f"invalid limit {limit}: it must be between 1 and {MAX_PAGE_SIZE}")
    return limit


def encode_cursor(conversation: Conversation) -> str:
    raw = json.dumps([epoch_millis(conversation.updated_at), conversation.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        millis, conversation_id = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if not isinstance(millis, int) or not isinstance(conversation_id, str):
            raise ValueError
        conversation_id.encode()  # UnicodeEncodeError (a ValueError) for a lone surrogate
        return from_epoch_millis(millis), conversation_id
    except (ValueError, TypeError, OverflowError, OSError, binascii.Error) as exc:
        raise InvalidInput(
            "invalid cursor: pass back the `next_cursor` of a previous page unchanged"
        ) from exc


MAX_SEARCH_SKIP = 2**31 - 1
"""The most hits a search cursor may pass over (a cursor served never comes near it)."""


def encode_search_cursor(after_rank: int) -> str:
    """The cursor of the search page after the hit ranked `after_rank`."""
    raw = json.dumps({"after_rank": after_rank}).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_search_cursor(cursor: str) -> int:
    """The rank a search cursor reads on after (`encode_search_cursor`); InvalidInput for
    anything else."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        decoded = json.loads(base64.urlsafe_b64decode(padded.encode()))
        after_rank = decoded["after_rank"] if isinstance(decoded, dict) else None
        if type(after_rank) is not int or not 0 < after_rank <= MAX_SEARCH_SKIP:
            raise ValueError
        return after_rank
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        raise InvalidInput(
            "invalid cursor: pass back the `next_cursor` of a previous search page unchanged"
        ) from exc


def _version_mismatch(conversation_id: str, what: str = "deleted") -> VersionMismatch:
    return VersionMismatch(
        f"conversation {conversation_id!r} is not the one named: it was deleted and started "
        "again since that version was read, or the version is not one it was served; "
        f"nothing was {what} (read it again to see what is there now)"
    )


def _require_version(
    conversation_id: str, found: Mapping[str, Any], version: str | None, what: str = "deleted"
) -> None:
    """VersionMismatch unless the conversation document `found` (its `epoch` and
    `created_at`) has `version`; None names any."""
    if version is None:
        return
    if conversation_version(conversation_id, found.get("epoch"), found["created_at"]) != version:
        raise _version_mismatch(conversation_id, what)


def _count_of(count: int) -> int | dict[str, Any]:
    """A filter on a count as read: 0 matches a document that has never set it too."""
    return count if count else {"$in": [0, None]}


def _one_of_or_none(*values: str | None) -> dict[str, Any]:
    """A filter on a field (`user_id`, `epoch`): documents holding one of these values, or
    none (null or absent)."""
    return {"$in": [*dict.fromkeys(v for v in values if v is not None), None]}


def _legacy_ids(found: dict[str, Any]) -> dict[str, Any]:
    """The legacy ids a conversation's document records, as `delete_dual_writes` takes them:
    the conversation's (`legacy_conversation_id`) and its derived owner's (`legacy_user_id`)."""
    return {
        "legacy_id": found.get("legacy_conversation_id"),
        "legacy_user_id": found.get("legacy_user_id"),
    }


_TO_DELETE = {
    "user_id": 1,
    "created_at": 1,
    "epoch_marks": 1,
    "legacy_conversation_id": 1,
    "legacy_user_id": 1,
    "epoch": 1,
}
"""What a delete reads of the conversation it deletes (`_found_to_delete`)."""


def _beside_of(conversation_id: str, found: dict[str, Any]) -> dict[str, Any]:
    """What a delete of the conversation `found` (its `epoch`, `created_at`, `epoch_marks`)
    takes in the collections beside the conversations: the documents of its thread written
    for this conversation (`ThreadLife`), whatever user they name (a claim moves the
    conversation before them), never those of a conversation started under the id since."""
    return thread_of(found | {"_id": conversation_id})


def _lives_of(found: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The messages of the lives of the conversations `found` (each its id and `epoch`, or
    none: stored before it had one), whatever user they name."""
    each = [{"conversation_id": d["_id"], "epoch": _one_of_or_none(d.get("epoch"))} for d in found]
    return {"$or": each}


def _message_life(found: Mapping[str, Any]) -> dict[str, Any]:
    """The messages of the conversation `found` (its `_id` and `epoch`): its life's, or stored
    before epochs were."""
    return {"conversation_id": found["_id"], "epoch": {"$in": [found.get("epoch"), None]}}


def _not_resolvable(
    conversation_id: str,
    request_id: str,
    pending: PendingHitl | None,
    held: Sequence[Mapping[str, Any]],
    asked_again: bool,
) -> PromptNotPending:
    """Why an answer to the prompt `request_id` matched nothing (`resolve_hitl`): the prompt,
    pending or open (holding calls no answer released, `held`) while another is the pending
    one, holds none of the calls it names, asked again since the answer was read (a prompt
    of the id asked after a named call was made, then this one: `asked_again`) or holding
    others; or no prompt of the id is open."""
    asked = pending is not None and pending.request_id == request_id
    if asked or held:
        where = f"in conversation {conversation_id!r}"
        if asked:
            said = f"the prompt {shown(request_id)} pending {where}"
        else:
            said = f"the prompt {shown(request_id)} {where}" + (
                f" (the pending one is {shown(pending.request_id)})" if pending else ""
            )
        if asked_again:
            return PromptNotPending(
                f"{said} holds none of the calls the answer names: it was asked again since "
                "the answer was read (read pending_calls again)"
            )
        calls = [
            f"{shown(str(c.get('tool_call_id')))} of message {shown(str(c.get('message_id')))}"
            for c in held
        ]
        holds = f"it holds {listed(calls, str)}" if calls else "it holds no call"
        return PromptNotPending(
            f"{said} holds none of the calls the answer names; {holds} (read pending_calls again)"
        )
    return PromptNotPending(
        f"no pending prompt {shown(request_id)} in conversation {conversation_id!r}"
        + (f"; the pending one is {shown(pending.request_id)}" if pending else "")
    )


_STANDING_READ = {"epoch": 1, "created_at": 1, "user_id": 1, "pops": 1, **UNSTANDING_READ}
"""What a read of messages looks up of their conversation, at once (`_in_scope`): with the
pops finished, which a streamed transcript pins at its first batch."""


def _scoped(found: Mapping[str, Any] | None, user_id: str | None) -> Mapping[str, Any] | None:
    """Of the conversation document `_in_scope` read under an id, what the caller `user_id`
    (any, for None) sees (`seen_by_caller`)."""
    owned = found is not None and user_id in (None, found.get("user_id"))
    return seen_by_caller(found, owned)


def _another_life(
    found: Mapping[str, Any], epoch: str | None, created_at: datetime | None = None
) -> bool:
    """Whether the conversation document `found` with the messages read (`_in_scope`) is
    another life of its id than the one a caller read before: the one of this `epoch` (a
    cursor message's, a conversation's), or, read before it had one, created at `created_at`;
    False when neither is known (a message stored before epochs: any life may hold it)."""
    if epoch is not None:
        return found.get("epoch") != epoch
    created = found.get("created_at")
    if created_at is None:
        return False
    return not isinstance(created, datetime) or to_utc_millis(created) != to_utc_millis(created_at)


def _cursor_of_another_life(conversation_id: str, after: str) -> InvalidInput:
    """The refusal of a page whose cursor `after` was found in a conversation deleted since,
    the one under the id now another started again (`_another_life`)."""
    return InvalidInput(
        f"invalid after: message {after!r} is of a conversation deleted since, and "
        f"conversation {conversation_id!r} is another one started again under its id: read it "
        "from its start (without after)"
    )


def _read_on_from(conversation: Mapping[str, Any], message_id: str) -> int | None:
    """The lowest `seq` given back from the removal of `message_id` on (`_seq_of`), or None
    when `conversation` lists no removal of it.

    Its earliest removal listed (`popped_messages`, oldest first): a turn popped whole and
    retried past its record is stored again at the end under the same ids, and can be popped
    again; a reader that read the first copy must read on from what the first pop gave back,
    and cannot be told from one that read the second, which is served again what was logged
    between (re-served, never skipped). An earlier removal no longer listed (past the newest
    `POPPED_MESSAGES_KEPT`) is not known. Only finished pops count from there on: a later
    pop under way (its mark, `popping`) has given nothing back (its message, which the
    reader had read, may still be stored), and no turn is logged at its `seq` before it
    finishes. The mark counts only as the removal of `message_id` itself, when no finished
    pop lists it: its message is deleted before the update that lists it clears the mark."""
    popped = [PoppedMessage.model_validate(p) for p in conversation.get("popped_messages") or ()]
    removals = [at for at, p in enumerate(popped) if p.message_id == message_id]
    if removals:
        return min(p.seq for p in popped[removals[0] :])
    marked = conversation.get("popping")
    if marked and marked.get("message_id") == message_id:
        return int(marked["seq"])
    return None


_PROMPTS_READ = {
    REFOLD_OWED: 1,
    PENDING_BLOCKS: 1,
    "pending_hitl": 1,
    "resolved_hitl": 1,
    "approved_calls": 1,
    "pending_calls": 1,
    "epoch": 1,
    "created_at": 1,
    "pops": 1,
    RELISTED: 1,
    **UNSTANDING_READ,
}
"""What an answer that resolved nothing reads to tell why (`resolve_hitl`), and to look at
the calls listed again it holds (`RELISTED`, `_relocated.looked_again`)."""


class ConversationStore:
    """Reads and administers conversations. Takes the same database handles as the logger."""

    def __init__(
        self, db: Database, *, legacy: LegacySource | None = None, rules: TurnRules | None = None
    ) -> None:
        """Read and administer `db`. `legacy` serves conversations not migrated yet (when its
        `read_fallback` is on) and is reached by deletes, erasures and claims. `rules` are the
        logger's (how long a tail read waits for a turn still being written)."""
        db = async_database(db)
        self._rules = rules or TurnRules()
        self._messages = db[MESSAGES]
        self._conversations = db[CONVERSATIONS]
        self._beside = [db[name] for name in THREAD_COLLECTIONS]
        self._checkpoints = db[LANGGRAPH_CHECKPOINTS]
        self._legacy_source = legacy
        self._full_texts = FullTextStore(db)
        self._deletions = DeletionRecords(db, self._full_texts)
        self._pops = PopMemory()

    @property
    def _listed(self) -> dict[str, Any]:
        """The filter part of a read of many conversations: `LISTED` (one the migration is
        still writing among them) while the read fallback serves such a one, else
        `STANDING`; with either, only conversation documents (`CONVERSATION_DOCUMENT`): a
        legacy turn an old-service writer logged into the collection is listed, exported
        and searched as no conversation, whatever the fallback."""
        source = self._legacy_source
        fence = LISTED if source is not None and source.read_fallback else STANDING
        return fence | CONVERSATION_DOCUMENT

    def _as_listed(self, scope: dict[str, Any]) -> dict[str, Any]:
        """A read's `scope` (`_standing`) taking what a list lists (`_listed`)."""
        return {name: on for name, on in scope.items() if name != MIGRATING} | self._listed

    async def _legacy(self, conversation_id: str, user_id: str | None) -> FallbackConversation:
        """A conversation not migrated yet, converted from its legacy turns; else NotFound,
        also when the conversation document under the id, whoever's (`seen_by_caller`), is
        one the fallback never serves (`refuse_unless_fallback_serves`: a delete that failed
        part-way marked it and left its legacy turns), read at once with them (one command
        more, no wait more).

        Only reached when a read found no conversation standing under this id, so reads of
        migrated conversations keep their round-trip counts.
        """
        missing = NotFound(f"conversation {conversation_id!r} was not found")
        source = self._legacy_source
        if source is None or not source.read_fallback:
            raise missing
        converted = partial(source.conversation, conversation_id, user_id=user_id)
        with storage_errors("read the conversation"):
            found, there = await _at_once(converted, partial(self._in_scope, conversation_id))
        refuse_unless_fallback_serves(conversation_id, _scoped(there, user_id))
        if found is None or (user_id is not None and found.conversation.user_id != user_id):
            raise missing
        return found

    async def ping(self) -> None:
        """One indexed lookup: raises StorageUnavailable when the database does not answer."""
        with storage_errors("reach the database"):
            await self._conversations.find_one({}, {"_id": 1})

    # -- conversations ---------------------------------------------------------------

    async def list_conversations(
        self, user_id: str, *, limit: int = 20, cursor: str | None = None
    ) -> ConversationPage:
        """A user's conversations, most recently updated first."""
        user_id = validate_identifier(user_id, "user_id")
        return await self._conversation_page({"user_id": user_id}, limit, cursor)

    async def recent_conversations(
        self, *, limit: int = 20, cursor: str | None = None
    ) -> ConversationPage:
        """Every user's conversations, most recently updated first (an operator's view)."""
        return await self._conversation_page({}, limit, cursor)

    async def _conversation_page(
        self, query: dict[str, Any], limit: int, cursor: str | None
    ) -> ConversationPage:
        limit = _page_size(limit)
        query |= self._listed
        if cursor is not None:
            query.update(_listed_after(*decode_cursor(cursor)))
        with storage_errors("list conversations"):
            docs, has_more = await _bounded_page(
                self._conversations,
                query,
                SUMMARY,
                [("updated_at", -1), ("_id", -1)],
                lambda last: _listed_after(last["updated_at"], last["_id"]),
                limit,
            )
        conversations = [Conversation.model_validate(d) for d in docs]
        return ConversationPage(
            data=conversations,
            has_more=has_more,
            first_id=conversations[0].id if conversations else None,
            last_id=conversations[-1].id if conversations else None,
            next_cursor=encode_cursor(conversations[-1]) if has_more else None,
        )

    async def get_conversation(
        self, conversation_id: str, *, user_id: str | None = None, fallback: bool = True
    ) -> Conversation:
        """One conversation document; NotFound if it is missing or not `user_id`'s.

        With `fallback=False`, a conversation not migrated yet is NotFound.
        """
        doc = await self._summary(conversation_id, user_id, SUMMARY, "read the conversation")
        if doc is None:
            if not fallback:
                raise NotFound(f"conversation {conversation_id!r} was not found")
            return (await self._legacy(conversation_id, user_id)).conversation
        return Conversation.model_validate(doc)

    async def stored_conversation(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> Conversation:
        """The conversation's document as the new collections hold it, one a migration run
        is still writing among them (its `migrating` True: every other read of the one
        conversation answers it from its legacy turns, and refuses its writes, until a run
        finishes it); NotFound when none is stored (not migrated yet, or none) or it is no
        conversation (a delete or a fork not made yet marked it). What an operator comparing
        the migrated side with the legacy turns reads (the viewer). One lookup."""
        doc = await self._summary(
            conversation_id, user_id, SUMMARY, "read the conversation", fence=LISTED
        )
        if doc is None:
            raise NotFound(f"conversation {conversation_id!r} was not found")
        return Conversation.model_validate(doc)

    async def stored_conversations(
        self, conversation_ids: Collection[str]
    ) -> dict[str, Conversation]:
        """`stored_conversation` of many ids at once, as a service sees them, by id (an id with
        none stored is absent): one round trip, whatever their number. What tells a caller
        holding documents of many conversations (the LangGraph checkpointer's list across
        threads) the life each id is now (`created_at`), and which the migration is still
        writing (`migrating`); a pop under way is left to the next read of its conversation
        (it changes neither)."""
        ids = sorted({validate_identifier(i, "conversation_id") for i in conversation_ids})
        if not ids:
            return {}
        with storage_errors("read the conversations"):
            docs = await self._conversations.find(
                {"_id": {"$in": ids}} | LISTED | CONVERSATION_DOCUMENT, SUMMARY
            ).to_list(None)
        return {str(doc["_id"]): Conversation.model_validate(doc) for doc in docs}

    async def _summary(
        self,
        conversation_id: str,
        user_id: str | None,
        projection: dict[str, Any],
        what: str,
        *,
        fence: dict[str, Any] = STANDING,
    ) -> dict[str, Any] | None:
        """The conversation `user_id` sees, read with `projection`, as its summary stands once
        no pop is under way: a pop's mark found (`popping`, read with it) is finished, and the
        conversation read again (`_pop.finish_marked`, as a turn's reservation finishes it),
        so no read serves the summary of a message a pop removed. Only one `fence` matches
        (`STANDING`; `LISTED` takes one being migrated too). One lookup; three more only when
        a mark is found. So too once no fold of its pending state is owed (`REFOLD_OWED`,
        read with it) and no block it watches holds a message (`_landed_unfolded`): the fold
        is written (`_relocated.settle`) and the conversation read again, three or four
        lookups more, only while one is owed or has landed."""
        query = self._scope(conversation_id, user_id) | fence
        included = any(on for name, on in projection.items() if name != "_id")
        marks = {"popping": 1, REFOLD_OWED: 1, PENDING_BLOCKS: 1, "epoch": 1, "created_at": 1}
        projection = {**projection, **marks} if included else {**projection}
        with storage_errors(what):
            doc: dict[str, Any] | None = await self._conversations.find_one(query, projection)
            if await finish_marked(self._messages, self._conversations, doc):
                doc = await self._conversations.find_one(query, projection)
        if doc is not None and await self._refolded(doc):
            with storage_errors(what):
                doc = await self._conversations.find_one(query, projection)
        return doc

    async def _refolded(self, conversation: Mapping[str, Any]) -> bool:
        """Whether a fold of the pending state `conversation` (read with `REFOLD_OWED`,
        `PENDING_BLOCKS`, `epoch` and `created_at`) is written now, one being owed or a block
        it watches holding a message (`_landed_unfolded`): what a read of the summary and an
        answer matching nothing do before they serve or refuse."""
        owed = conversation.get(REFOLD_OWED) is not None
        return (owed or await self._landed_unfolded(conversation)) and await self._folded(
            conversation
        )

    async def _landed_unfolded(self, conversation: Mapping[str, Any]) -> bool:
        """Whether a block the conversation watches (`watched_blocks`: a fold found it passed
        and empty) holds a message now: its turn's insert landed after that fold, its
        writer gone before folding it in. One `find`, only while a block is watched."""
        watched = watched_blocks(conversation, utc_now())
        found = await stored_among(
            self._messages, str(conversation["_id"]), conversation.get("epoch"), watched
        )
        return bool(found)

    async def _folded(self, conversation: Mapping[str, Any]) -> bool:
        """Whether the fold of the pending state `conversation` is owed is written now, to
        that life of it only (`same_as_read`): one deleted since, even started again under
        its id by anyone, is folded by nobody here."""
        conversation_id = str(conversation["_id"])
        return await settle(
            self._conversations,
            self._messages,
            conversation_id,
            None,
            abandon_after=self._rules.abandon_after,
            name_chars=self._rules.name_chars,
            life=same_as_read(conversation_id, conversation),
        )

    async def require_version(
        self,
        conversation_id: str,
        version: str | None,
        *,
        user_id: str | None = None,
        what: str | None = None,
    ) -> None:
        """`VersionMismatch` unless the conversation under the id is the one `version`
        (`Conversation.version`, an ETag as served; None: any) names, as `delete` checks
        it; NotFound when there is none visible to `user_id`. One round trip (more for a
        conversation that exists only as legacy turns). What a call about to act on the
        conversation it read checks first: one deleted and started again since is another.
        For a write (`what`), one `user_id` holds that is no conversation is refused as the
        write is without a version (`refuse_unless_found_standing`: 503 being deleted, not
        NotFound; one round trip more, on that path only)."""
        try:
            found = await self.get_conversation(conversation_id, user_id=user_id)
        except NotFound:
            if what is not None:
                scope = self._scope(conversation_id, user_id)
                await refuse_unless_found_standing(self._conversations, scope, what)
            raise
        if version is not None and found.version != version:
            raise _version_mismatch(conversation_id, "done")

    async def require_standing(self, conversation_id: str, version: str) -> None:
        """NotFound unless the conversation `version` (`Conversation.version`) names is still
        under the id and no delete or erasure of it has begun (its `DeletionRecords` record),
        as a fork checks its source after its writes: a deletion recording itself after this
        check began finds whatever the caller wrote before it. Three round trips: the
        conversation, its record, then the conversation again (a deletion that finished
        between the first two is seen gone)."""
        gone = NotFound(f"conversation {conversation_id!r} was not found")
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"epoch": 1, "created_at": 1}
            )
        life = None if found is None else life_named(conversation_id, found, version)
        if found is None or life is None:  # none, or another one under the id: it went
            raise gone
        if await self._deletions.under_way(conversation_id, found):
            raise gone
        with storage_errors("read the conversation"):
            still = await self._conversations.find_one(life, {"_id": 1})
        if still is None:
            raise gone

    async def turn_count(self, conversation_id: str, *, user_id: str | None = None) -> int:
        doc = await self._summary(
            conversation_id, user_id, {"turn_count": 1}, "read the turn count"
        )
        if doc is None:
            return (await self._legacy(conversation_id, user_id)).conversation.turn_count
        return int(doc.get("turn_count", 0))

    async def rename(
        self,
        conversation_id: str,
        name: str,
        *,
        user_id: str | None = None,
        version: str | None = None,
    ) -> Conversation:
        """Set a person's name for the conversation; automatic names never replace it.

        With `version`, only the conversation it names (`delete`): another under the id is
        `VersionMismatch`, nothing renamed (one more round trip, to read it first)."""
        clean = clean_name(name)
        scope = self._scope(conversation_id, user_id)
        if version is not None:
            scope = await self._named(conversation_id, user_id, version)
        with storage_errors("rename the conversation"):
            doc = await self._conversations.find_one_and_update(
                scope | STANDING,
                {"$set": {"name": clean, "name_source": "set"}},
                projection=SUMMARY,
                return_document=ReturnDocument.AFTER,
            )
        if doc is None:
            await refuse_unless_found_standing(self._conversations, scope, "the rename")
        if doc is None and version is not None:
            await self._named(conversation_id, user_id, version)  # NotFound when gone
            raise _version_mismatch(conversation_id, "renamed")
        if doc is None:
            await self._refuse_unmigrated(conversation_id, user_id, "renamed")
        return Conversation.model_validate(doc)

    async def _named(
        self, conversation_id: str, user_id: str | None, version: str
    ) -> dict[str, Any]:
        """A filter for the conversation `version` names, read now (one round trip):
        `VersionMismatch` when the one under the id has another version, NotFound (or, for
        one that exists only as legacy turns, `VersionMismatch` when it has another version,
        else Conflict, not migrated yet) when there is none."""
        scope = self._scope(conversation_id, user_id)
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                scope | STANDING, {"epoch": 1, "created_at": 1}
            )
        if found is None:
            await refuse_unless_found_standing(self._conversations, scope, "the rename")
            await self._refuse_unmigrated(conversation_id, user_id, "renamed", version=version)
        assert found is not None  # else `_refuse_unmigrated` raised
        _require_version(conversation_id, found, version, "renamed")
        return scope | same_as_read(conversation_id, found)

    async def _refuse_unmigrated(
        self, conversation_id: str, user_id: str | None, what: str, *, version: str | None = None
    ) -> None:
        """NotFound, or for a conversation that exists only as legacy turns: `VersionMismatch`
        when `version` names another than the one served from them (the tag is compared
        first, as a delete compares it: `_delete_legacy_only`), else Conflict
        (`not_migrated_yet`)."""
        fallback = await self._legacy(conversation_id, user_id)
        if version is not None and fallback.conversation.version != version:
            raise _version_mismatch(conversation_id, what)
        raise not_migrated_yet(conversation_id, what)

    async def delete(
        self,
        conversation_id: str,
        *,
        user_id: str | None = None,
        version: str | None = None,
        unchanged_since: Conversation | None = None,
    ) -> Deleted:
        """Delete a conversation: its messages, its document, its owner's legacy turns and
        what integrations keep beside it (`THREAD_COLLECTIONS`: a LangGraph thread's
        checkpoints).

        With `version` (`Conversation.version`), only the conversation it names, checked on
        the first read (`_found_to_delete`): another is `VersionMismatch`, nothing deleted.
        With `unchanged_since` (the conversation as the caller read it, whose version it
        names), only while nothing was written to it since that read: no turn, pop or claim
        (its `message_count`, `pops` and owner as read, checked in the command that marks it
        deleting, so a turn landing after the caller's check is never deleted though
        acknowledged); otherwise `Conflict`, nothing deleted. Given both, both are checked.

        Legacy turns go first, then the documents beside it (they refer to the messages), then
        messages and their whole texts, then the conversation document: a crash part-way leaves
        something a repeated delete finishes, never messages without their conversation, and
        never legacy turns that a migration re-run or the read fallback would bring back to
        life. Each step takes the conversation the delete found only, told by its `epoch`
        (`same_conversation`) from one started under the id since, by anyone, whatever its
        `created_at`: the documents beside it written for it (or for no conversation named)
        and the messages of its life (its `epoch`, or none), whatever user they name (a claim
        moves it before them), once a lookup finds it still under its id; the whole texts no
        message left under the id names, but those of a conversation started under the id
        since (`FullTextStore.forget_conversations`); its document while it is the one found. A
        delete finding it gone by then (another delete of it finished first: a client's retry)
        stops there, as for a deleted conversation. A turn that reserved before the delete and
        inserts during it is swept last, and once more `TurnRules.claim_grace` later when a
        reserved `seq` held no message (the delete returns then); a conversation created under
        the id meanwhile, by anyone, is left whole, and the owner's turns dual-written under the
        id meanwhile are deleted too. Legacy turns and prompts under the id that name another
        user than the document's owner stay (see `LegacySource.delete`). The delete is
        recorded (`DeletionRecords`) before its first destructive command and the record
        removed as its last step: a repeated delete finding no conversation (the first failed
        once the document went) finishes it (`_finish_delete`).
        """
        scope = self._scope(conversation_id, user_id)
        found = await self._found_to_delete(scope, version)
        if found is not None and unchanged_since is not None:
            _require_version(conversation_id, found, unchanged_since.version)
        if unchanged_since is not None:
            version = unchanged_since.version
        if found is None:
            return await self._finish_delete(conversation_id, user_id, version)
        marked: dict[str, Any] | Deleted
        if unchanged_since is not None:
            marked = await self._marked_unchanged(conversation_id, found, unchanged_since)
        else:
            marked = await self._marked_to_delete(conversation_id, found, user_id, version)
        if isinstance(marked, Deleted):
            return marked
        return await self._delete_marked(scope, marked)

    async def _delete_marked(self, scope: dict[str, Any], found: dict[str, Any]) -> Deleted:
        """The steps of `delete` once it marked the conversation it found (`found`, within
        `scope`), each scoped to it."""
        conversation_id = str(found["_id"])
        owner = found.get("user_id")
        legacy = 0
        if self._legacy_source is not None:
            legacy = await self._legacy_source.delete(conversation_id, owner=owner)
        await self._delete_beside(_beside_of(conversation_id, found), "delete the conversation")
        found_now = scope | same_as_read(conversation_id, found)
        taken = await self._delete_messages_of(found_now, found.get("epoch"))
        if taken is None:
            await self._deletions.done(recorded_as(conversation_id, found))
            return Deleted(conversations=0, messages=0, legacy_turns=legacy)
        messages, epochs = taken
        await self._full_texts.forget_conversations({conversation_id: epochs})
        gone, late = await self._delete_document(found_now, messages)
        if self._legacy_source is not None:
            legacy += await self._legacy_source.delete_dual_writes(
                conversation_id, owner=owner, **_legacy_ids(found)
            )
        await self._deletions.done(recorded_as(conversation_id, found))
        return Deleted(
            conversations=int(gone is not None), messages=messages + late, legacy_turns=legacy
        )

    async def _marked_unchanged(
        self, conversation_id: str, found: dict[str, Any], as_read: Conversation
    ) -> dict[str, Any]:
        """Record and mark the conversation a delete found, as `_marked_to_delete` does, while
        it is also as the caller read it (`as_read`): the same owner, `message_count` and
        `pops`, no pop under way. Conflict, nothing marked, when a turn, a pop or a claim
        landed since that read."""
        unchanged = {
            "message_count": _count_of(as_read.message_count),
            "pops": _count_of(as_read.pops),
            "popping": None,
        }
        owner = found.get("user_id")
        if owner != as_read.user_id or not await self._deletions.record(
            [found], owner, where=unchanged
        ):
            raise Conflict(
                f"conversation {conversation_id!r} was written to since it was read (a turn, a "
                "pop or a claim): nothing was deleted (read it again to see what is there now)"
            )
        return found

    async def _marked_to_delete(
        self,
        conversation_id: str,
        found: dict[str, Any],
        user_id: str | None,
        version: str | None,
    ) -> dict[str, Any] | Deleted:
        """Record and mark the conversation a delete found (`DeletionRecords.record`) while
        it is the one found and its owner is the one read: the conversation as marked, or
        the delete's answer when there is none to mark. When the mark misses, the delete reads
        again the one it found: deleted since, it answers `conversations: 0`; a service's
        delete marks it under the owner it has now (claimed or assigned since); a user's
        delete of one claimed away from the user since answers as a delete read after the
        claim does (`_finish_delete`: NotFound), never as deleted while it stands."""
        while not await self._deletions.record([found], found.get("user_id")):
            with storage_errors("read the conversation"):
                again = await self._conversations.find_one(
                    same_as_read(conversation_id, found), _TO_DELETE
                )
            if again is None:
                return Deleted(conversations=0, messages=0, legacy_turns=0)
            if user_id is not None and again.get("user_id") != user_id:
                return await self._finish_delete(conversation_id, user_id, version)
            found = again
        return found

    async def _delete_document(
        self, found_now: dict[str, Any], messages: int
    ) -> tuple[dict[str, Any] | None, int]:
        """Delete the conversation document `found_now` selects, once `messages` of its
        messages went, then sweep for the turns that reserved before the delete (and, when
        a reserved `seq` held no message, once more after the grace): what it was (None if
        gone meanwhile) and how many messages the sweeps took."""
        conversation_id = found_now["_id"]
        with storage_errors("delete the conversation"):
            gone = await self._conversations.find_one_and_delete(
                found_now, {"user_id": 1, "message_count": 1, "turns": 1, "epoch": 1}
            )
            late = await self._sweep_late_inserts(conversation_id, gone) if gone else 0
        if gone is not None and messages + late < int(gone.get("message_count") or 0):
            late += await self._sweep_after_grace(conversation_id, gone)
        return gone, late

    async def _finish_delete(
        self, conversation_id: str, user_id: str | None, version: str | None
    ) -> Deleted:
        """A delete finding no conversation: it finishes the deletions of the id (the
        caller's, for a user's delete) that failed part-way, then deletes what the read
        fallback reaches. NotFound when neither finds anything."""
        scope = {"conversation_id": conversation_id}
        if user_id is not None:
            scope["user_id"] = user_id
        swept = await self._deletions.finish(scope, self._grace)
        # Late inserts of one deleted since, their writer gone before taking them back.
        swept += await self._sweep_strays(scope, "delete the conversation")
        try:
            return await self._delete_legacy_only(conversation_id, user_id, version)
        except NotFound:
            if not swept:
                raise
        return Deleted(conversations=0, messages=swept, legacy_turns=0)

    async def _sweep_strays(self, scope: dict[str, Any], action: str) -> int:
        """Delete the messages `scope` selects that no conversation standing under their id
        holds (`_lives_of_no_conversation`), whatever user they name, with their whole texts,
        by their conversations' ids and epochs: never those of a conversation started under
        the id meanwhile (another epoch). How many; one lookup when `scope` selects none, two
        round trips more when any is there."""
        lives = await self._lives_of_no_conversation(scope, {}, action)
        if not lives:
            return 0
        each = [{"conversation_id": c, "epoch": {"$in": list(e)}} for c, e in lives.items()]
        with storage_errors(action):
            swept = await self._messages.delete_many({"$and": [scope, {"$or": each}]})
        await self._full_texts.forget_conversations(lives)
        return int(swept.deleted_count)

    async def _lives_of_no_conversation(
        self, scope: dict[str, Any], holders: dict[str, Any], action: str
    ) -> dict[str, set[str | None]]:
        """The conversations, each id's `epoch`s, whose messages `scope` selects and that no
        conversation standing under their id now holds (of those `holders` selects): deleted,
        their late inserts or what their writers left, or never created. A conversation started
        under the id since keeps its messages, told by its `epoch` (and those of none, stored
        before epochs), and one started after this lookup draws an epoch not listed: a delete
        by these, however late it reaches the server, takes nothing of either. One round trip
        when `scope` selects no message, two otherwise."""
        with storage_errors(action):
            found = await self._messages.find(scope, {"conversation_id": 1, "epoch": 1}).to_list(
                None
            )
            if not found:
                return {}
            ids = list({d["conversation_id"] for d in found})
            standing = await self._conversations.find(
                {"_id": {"$in": ids}, **holders, **CONVERSATION_DOCUMENT}, {"epoch": 1}
            ).to_list(None)
        held = {d["_id"]: (d.get("epoch"), None) for d in standing}
        lives: dict[str, set[str | None]] = {}
        for d in found:
            if d.get("epoch") not in held.get(d["conversation_id"], ()):
                lives.setdefault(d["conversation_id"], set()).add(d.get("epoch"))
        return lives

    async def _found_to_delete(
        self, scope: dict[str, Any], version: str | None
    ) -> dict[str, Any] | None:
        """A delete's first read: the conversation it deletes, or None when there is none.
        With `version`, `VersionMismatch` when the one under the id is another (deleted and
        started again since the version was read, by anyone) or has another version: the
        one step of a delete not scoped to the conversation it found is checked here, and
        every later one is scoped to what this read found (`same_conversation`)."""
        with storage_errors("read the conversation"):
            found: dict[str, Any] | None = await self._conversations.find_one(scope, _TO_DELETE)
        if found is not None:
            _require_version(scope["_id"], found, version)
        return found

    async def _delete_messages_of(
        self, found_now: dict[str, Any], epoch: str | None
    ) -> tuple[int, tuple[str | None, ...]] | None:
        """Delete the messages of the life of the conversation `found_now` selects (its id,
        scope and `epoch`, or `created_at` for one found without: `same_conversation`): those
        carrying its `epoch` (as found, or as a first turn after an upgrade set it) or none,
        whatever user they name (its owner; none, logged before a turn assigned it; the old id
        of a claim that moved it and not yet its messages); how many, and those epochs (its
        whole texts are told by them). None, deleting nothing, when a lookup (one round trip)
        finds it no longer there: deleted meanwhile, and perhaps started again under its id by
        anyone. A delete reaching the server however late takes nothing of a conversation
        started under the id since: its messages carry another epoch."""
        with storage_errors("delete the conversation"):
            still = await self._conversations.find_one(found_now, {"epoch": 1})
            if still is None:
                return None
            epochs = (epoch, still.get("epoch"))
            deleted = await self._messages.delete_many(
                {"conversation_id": found_now["_id"], "epoch": _one_of_or_none(*epochs)}
            )
        return int(deleted.deleted_count), epochs

    async def _sweep_after_grace(self, conversation_id: str, gone: dict[str, Any]) -> int:
        """A seq reserved and not stored: a turn may still be inserting. One faster than the
        grace is swept `TurnRules.claim_grace` later; a slower one deletes its own
        (`log_messages`)."""
        await self._grace()
        with storage_errors("delete the conversation"):
            again = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"turns.k": 1}
            )
        taken = {r.get("k") for r in (again or {}).get("turns") or ()}
        return await self._sweep_late_inserts(conversation_id, gone, spare=taken, any_owner=True)

    async def _grace(self) -> None:
        """The wait before a last sweep for turns still inserting: `TurnRules.claim_grace`."""
        await pause(self._rules.claim_grace.total_seconds())

    async def _delete_legacy_only(
        self, conversation_id: str, user_id: str | None, version: str | None
    ) -> Deleted:
        """A conversation the caller reaches through the read fallback only (NotFound if it
        does not): its legacy owner's turns and prompts go, and nothing of the new
        collections, where another user may hold the id."""
        fallback = await self._legacy(conversation_id, user_id)
        if version is not None and fallback.conversation.version != version:
            raise _version_mismatch(conversation_id)
        assert self._legacy_source is not None  # else `_legacy` raised NotFound
        owner = fallback.conversation.user_id
        legacy = await self._legacy_source.delete(conversation_id, owner=owner)
        return Deleted(conversations=0, messages=0, legacy_turns=legacy)

    async def _sweep_late_inserts(
        self,
        conversation_id: str,
        gone: dict[str, Any],
        *,
        spare: Collection[Any] = (),
        any_owner: bool = False,
    ) -> int:
        """Messages a turn reserved before the delete inserted after its first sweep: those
        of the deleted conversation only (its owner, below its `message_count`, of a turn it
        recorded), never those of a conversation created under the id since, by anyone: by
        another owner, or by the same one, whose turns of an id the deleted one recorded
        too (`spare`: the keys the conversation under the id records now) stay. The last
        sweep (`any_owner`, with `spare` read then) takes those naming any owner: a claim
        moves a conversation before its messages, which name the old owner meanwhile."""
        recorded = {r.get("k") for r in gone.get("turns") or ()}  # the records' keys, as stored
        recorded -= set(spare)
        query: dict[str, Any] = {
            "conversation_id": conversation_id,
            "seq": {"$lt": int(gone.get("message_count") or 0)},
            "epoch": _one_of_or_none(gone.get("epoch")),
        }
        if not any_owner:
            query["user_id"] = gone.get("user_id")
        with storage_errors("delete the conversation"):
            found = await self._messages.find(query, {"turn_id": 1}).to_list(None)
            late = [d["_id"] for d in found if turn_key(str(d.get("turn_id"))) in recorded]
            if not late:
                return 0
            swept = await self._messages.delete_many(
                {"conversation_id": conversation_id, "_id": {"$in": late}}
            )
        return int(swept.deleted_count)

    # -- messages --------------------------------------------------------------------

    async def transcript(
        self, conversation_id: str, *, user_id: str | None = None, fallback: bool = True
    ) -> list[AgentMessage]:
        """Every message of a conversation in `seq` order, in one round trip: its messages
        and its document, which says whether they are a conversation's (`_its_messages`), read
        at once.

        With `fallback=False`, a conversation not migrated yet has no messages
        rather than those converted from its legacy turns.
        """
        found = self._transcript_cursor(conversation_id, user_id)
        docs = await self._of_standing(
            conversation_id, user_id, partial(found.to_list, None), "read the transcript"
        )
        if docs is None:  # no conversation document: a conversation not migrated yet, or none
            conversion = await self._legacy(conversation_id, user_id)
            return conversion.messages if fallback else []
        return messages_adapter.validate_python(docs)

    def _transcript_cursor(self, conversation_id: str, user_id: str | None) -> Any:
        """The cursor over the messages under a conversation's id (the user's only, when
        named), in `seq` order: what a transcript reads."""
        query = {"conversation_id": validate_identifier(conversation_id, "conversation_id")}
        if user_id is not None:
            query["user_id"] = validate_identifier(user_id, "user_id")
        return self._messages.find(query).sort("seq", 1).batch_size(TRANSCRIPT_BATCH)

    async def stored_transcript(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> list[AgentMessage]:
        """Every message the new collections hold for the conversation, in `seq` order, as
        `transcript` reads them, one a migration run is still writing among them
        (`stored_conversation`): the messages it stored so far. None for a conversation not
        migrated yet (an empty list, as for none); NotFound for one a delete or a fork not
        made yet marked. One round trip: its messages and its document, read at once."""
        found = self._transcript_cursor(conversation_id, user_id)
        with storage_errors("read the stored messages"):
            docs, conversation = await _at_once(
                partial(found.to_list, None), partial(self._in_scope, conversation_id)
            )
        stored = _its_messages(
            conversation_id, _scoped(conversation, user_id), docs, being_migrated=True
        )
        return messages_adapter.validate_python(stored or [])

    async def with_full_texts(self, messages: list[AgentMessage]) -> list[AgentMessage]:
        """The messages with every field cut to bound them put back whole, from GridFS.

        Costs two lookups when any message was cut, none otherwise. A field whose
        whole text is not found stays cut and listed in `truncated`.
        """
        return await self._full_texts.restore(messages)

    async def with_native_forms(self, messages: list[AgentMessage]) -> list[AgentMessage]:
        """The messages whose runtime form (`native`) was cut to bound them, put back whole.

        What a runtime's history reads, so it gets back what it stored: two lookups when a
        message lost its native form, none otherwise. Such a message gets its other cut
        fields back too; the rest keep theirs cut.
        """
        cut = [i for i, m in enumerate(messages) if m.truncated and NATIVE in m.truncated]
        if not cut:
            return messages
        restored = await self.with_full_texts([messages[i] for i in cut])
        whole = list(messages)
        for index, message in zip(cut, restored, strict=True):
            whole[index] = message
        return whole

    async def recent_messages(
        self, conversation_id: str, *, limit: int | None = None, user_id: str | None = None
    ) -> list[AgentMessage]:
        """The last `limit` messages of a conversation (all with None), in `seq` order.

        One round trip for up to 10,000 messages, the conversation document read with them; a
        conversation that does not exist, or is no conversation (`_its_messages`), has none.
        The last `limit` are the conversation's own: when a late insert of a life a delete
        ended lies among them, they are read again with its `epoch` in the query (`_of_life`,
        one round trip more), never fewer. No legacy fallback: for runtimes that keep their
        own history here.
        """
        query = {"conversation_id": validate_identifier(conversation_id, "conversation_id")}
        if user_id is not None:
            query["user_id"] = validate_identifier(user_id, "user_id")
        if limit is not None and (isinstance(limit, bool) or limit < 1):
            raise InvalidInput(f"invalid limit {limit!r}: it must be at least 1, or None for all")

        def read(life: Mapping[str, Any]) -> Awaitable[list[dict[str, Any]]]:
            if limit is None:
                cursor = self._messages.find(query).sort("seq", 1).batch_size(TRANSCRIPT_BATCH)
            else:
                cursor = self._messages.find({**query, **life}).sort("seq", -1).limit(limit)
                cursor = cursor.batch_size(min(limit, TRANSCRIPT_BATCH))
            found: Awaitable[list[dict[str, Any]]] = cursor.to_list(None)
            return found

        docs = await self._of_standing(
            conversation_id,
            user_id,
            partial(read, {}),
            "read the last messages",
            absent_is_empty=True,
            again=None if limit is None else read,
        )
        docs = docs or []
        if limit is not None:
            docs = docs[::-1]
        return messages_adapter.validate_python(docs)

    async def pop_last_message(
        self, conversation_id: str, *, user_id: str | None = None, refuse: Refusal | None = None
    ) -> AgentMessage | None:
        """Remove the conversation's last message and return it as it was logged, its cut
        fields read back whole before their whole texts are deleted; None when it has none.

        The conversation's summary is corrected as if the message had never been logged
        (see `agent_store.store._tail`): its turn, tokens, preview and pending prompt, an
        automatic name taken from it (the next turn names the conversation anew), and
        `message_count`, which gives the `seq` back unless another turn reserved past it;
        its turn's record is marked popped, so a retry of that turn is a Conflict.

        The pop rolls forward (see `agent_store.store._pop`): it marks the conversation,
        removes the message, then corrects the summary and clears the mark. A pop left half
        done is finished by the next one; after StorageUnavailable, call again through this
        store with the same `user_id` (from the same task, or any while it is the only pop
        of the scope in doubt): the retry answers the message its earlier attempt removed
        from this conversation (a conversation deleted and started again under the id is
        another; one claimed by another user id since is still finished, and answered), and
        removes no other (a pop of another scope is never taken for it; a call that cannot
        be told among several pops in doubt is a Conflict, removing nothing). It removes
        the last message by `seq`: while a turn that reserved past it, or a turn below it
        whose messages what removing it changes depends on, is still being written
        (younger than `TurnRules.abandon_after`), it raises StorageUnavailable and removes
        nothing. A message a LangGraph checkpoint of the conversation refers to is not
        removed (Conflict: go back through the graph, or delete the thread), nor one the
        checkpointer logged that none refers to yet, younger than `abandon_after`
        (StorageUnavailable: its checkpoint may be on its way). Five to eight round trips:
        the last message, the checkpoints referring to it, the mark, the removal,
        the summary update, and the messages before it when it started a turn or was the
        preview's source, or (all of them) when it answered a call or raised a prompt (what
        they leave pending says what comes back; one more for the answers a person gave
        and the approvals, when a prompt is among them or is the message, or in a fork, where
        its copies began the original's turns). Three more when this store has not seen the
        conversation's count of finished pops yet and another pop was finished before, or
        when it passes a block abandoned past the last message; one more when the reads of
        the messages before it find a `seq` with no message (the conversation's gaps).
        Four more for a cut message: its whole texts read back, then deleted. `refuse`
        checks the last message as read before anything is written: an error it returns is
        raised, nothing removed (the Agents SDK session's refusal of a message of several items).
        """
        query = {"conversation_id": validate_identifier(conversation_id, "conversation_id")}
        if user_id is not None:
            query["user_id"] = validate_identifier(user_id, "user_id")
        pop = Pop(
            messages=self._messages,
            conversations=self._conversations,
            scope=self._scope(conversation_id, user_id),
            query=query,
            calls_before=self._pending_before,
            preview_chars=self._rules.preview_chars,
            name_chars=self._rules.name_chars,
            memory=self._pops,
            abandon_after=self._rules.abandon_after,
            forget_texts=self._full_texts.forget_files,
            restore=self._full_texts.restore,
            checkpoints=self._checkpoints,
            refuse=refuse,
        )
        return await pop.run()

    async def _pending_before(self, popped: AgentMessage) -> LeftBefore:
        """What the messages before `popped` leave (reads them all: a pop of an answer or a
        prompt is rare, and what is pending depends on every turn, on how far a person's
        answers reach when a prompt was asked, and in a fork on where its copies began the
        original's turns), folded with the answers a person gave as a fork of them all folds
        them (`folded_after`): the calls and the prompt pending, the approvals none of those
        answers gives (`approvals_withdrawn`); and the `seq`s below it with no message that a
        turn may still hold (the pop waits for a turn still writing one), not the gaps the
        conversation records no turn holds (`Gaps.held`): those are as if never reserved, as
        are the blocks passed (`Gaps.written`: a dead turn's, never stored in place), and
        neither keeps the fold from settling; a block is judged by its age when the messages
        were read (the clock read before they were), as a page judges it. One lookup more of
        the conversation when a prompt is among them or is `popped`, or they are a fork's."""
        read_at = utc_now()
        docs = await (
            self._messages.find(
                {"conversation_id": popped.conversation_id, "seq": {"$lt": popped.seq}}
            )
            .sort("seq", 1)
            .to_list(None)
        )
        messages = messages_adapter.validate_python(docs)
        forked = any(is_fork_turn(m.turn_id) for m in messages)
        conversation: Mapping[str, Any] | None = None
        if forked or any(m.hitl_action is not None for m in [*messages, popped]):
            conversation = await self._conversations.find_one(
                conversation_by_id(popped.conversation_id),
                {"forked_from.turn_starts": 1, **LEFT_BEFORE_READ, **GAPS_READ},
            )
        starts = fork_turns_of(conversation or {}) if forked else []
        answered = answered_in(conversation)
        folded = folded_after(messages, starts, answered)
        stored = {m.seq for m in messages}
        assert popped.seq is not None
        gaps = Gaps.of(conversation)
        missing = gaps.held(seq for seq in range(popped.seq) if seq not in stored)
        writing = gaps.written(missing, now=read_at, abandon_after=self._rules.abandon_after)
        return LeftBefore(
            calls=folded.calls,
            prompt=folded.hitl,
            withdrawn=approvals_withdrawn(
                (conversation or {}).get("approved_calls") or (), answered, folded
            ),
            missing=missing,
            settled=None
            if conversation is None or writing is not None
            else settled(conversation, folded),
        )

    async def messages_by_seq(
        self,
        conversation_id: str,
        *,
        start: int = 0,
        stop: int | None = None,
        limit: int | None = None,
        user_id: str | None = None,
        life: Conversation | None = None,
    ) -> list[AgentMessage]:
        """The stored messages with `start <= seq < stop` (to the end without `stop`), by `seq`;
        the first `limit` of them when given (a page of a long transcript).

        One range scan of the `{conversation_id, seq}` index, with the conversation document
        read at once (none for one that does not exist or is no conversation, `_its_messages`),
        for callers that keep a position in the transcript (the LangGraph checkpointer). A `seq`
        reserved but not stored is simply absent. No legacy fallback: legacy turns have no `seq`.
        With `life` (the conversation as read before, a page's header), its messages only:
        NotFound when that conversation is gone, deleted, or started again under the id since.
        """
        if start < 0 or (stop is not None and stop < start):
            raise InvalidInput(f"invalid seq range {start}..{stop}: need 0 <= start <= stop")
        query = _seq_range(conversation_id, start, stop, user_id)
        if limit is not None and limit < 1:
            raise InvalidInput(f"invalid limit {limit}: it must be at least 1")
        found = self._messages.find(query).sort("seq", 1).batch_size(TRANSCRIPT_BATCH)
        if limit is not None:
            found = found.limit(limit)
        read = partial(found.to_list, None)
        docs = await self._of_standing(
            conversation_id, user_id, read, "read messages", absent_is_empty=True, life=life
        )
        return messages_adapter.validate_python(docs or [])

    async def seq_page(
        self,
        conversation_id: str,
        *,
        start: int = 0,
        limit: int,
        user_id: str | None = None,
        life: Conversation | None = None,
        being_migrated: bool = False,
    ) -> MessagePage:
        """A page of the stored messages from `seq` `start` on, by `seq`, bounded by bytes as
        every page is: the first `limit`, fewer when they pass `PAGE_BYTES` (one at least),
        `has_more` when more follow (read on from the last `seq` served plus one). What a
        viewer page of a transcript reads: `messages_by_seq` as to the conversation (`life`,
        `user_id`, no legacy fallback; with `being_migrated`, one a migration run is writing
        serves the messages stored so far, as `stored_transcript`), read in batches
        (`_bounded_page`) so that no read holds much more than a page whatever each message
        holds."""
        if start < 0 or limit < 1:
            raise InvalidInput(
                f"invalid page from seq {start}, limit {limit}: need 0 and 1 at least"
            )
        query = _seq_range(conversation_id, start, None, user_id)
        more = False

        async def read() -> list[dict[str, Any]]:
            nonlocal more
            docs, more = await _bounded_page(self._messages, query, None, *_by_seq("asc"), limit)
            return docs

        docs = await self._of_standing(
            conversation_id, user_id, read, "read messages", absent_is_empty=True, life=life,
            being_migrated=being_migrated,
        )  # fmt: skip
        messages = messages_adapter.validate_python(docs or [])
        return MessagePage(
            data=messages,
            has_more=more and bool(messages),
            first_id=messages[0].id if messages else None,
            last_id=messages[-1].id if messages else None,
        )

    async def calls_before(
        self,
        conversation_id: str,
        call_ids: Collection[str],
        *,
        before_seq: int,
        user_id: str | None = None,
        life: Conversation | None = None,
    ) -> list[AgentMessage]:
        """The stored messages below `before_seq` that pair the tool results of a page
        starting there with their calls as the whole transcript pairs them (`calls_answered`
        over these and the page's): for each id of `call_ids`, the messages making or
        answering it, by `seq`, from the page down to its latest call still without an
        answer, or its n-th latest for an id given n times (n results of the page answer no
        call on it); down to its first for fewer (a result then answers the id's latest
        call). An id no message makes gives none.

        A scan of the `{conversation_id, seq}` index down from `before_seq`, of the messages
        making or answering an id still unpaired, `PAGE_FIRST_BATCH` at a time: one round
        trip unless more such messages lie between the page and the calls its results take
        (an id whose every earlier call is answered is read down to its first), the
        conversation document read with the first (`_of_standing`: none of one that is no
        conversation; with `life`, NotFound when that one is no longer under the id, as
        `messages_by_seq`); none for no ids. The messages are the conversation's own: when the
        scan met a late insert of a life a delete ended, it is made again with the life's
        `epoch` in its query (`_of_life`, as a window of the last messages is), so another
        life's calls never take a page's results nor end the scan. No legacy fallback: a
        conversation not migrated yet is read whole.
        """
        if isinstance(before_seq, bool) or not isinstance(before_seq, int) or before_seq < 0:
            raise InvalidInput(f"invalid before_seq {before_seq!r}: it must be a seq, 0 or more")
        needed = Counter(call_ids)
        if not all(isinstance(call_id, str) for call_id in needed):
            raise InvalidInput("invalid call_ids: each must be a tool call id, as text")
        scope: dict[str, Any] = {
            "conversation_id": validate_identifier(conversation_id, "conversation_id")
        }
        if user_id is not None:
            scope["user_id"] = validate_identifier(user_id, "user_id")
        if not needed:
            return []
        validated: dict[Any, AgentMessage] = {}
        read = partial(self._paired_calls, scope, needed, before_seq, validated)
        step = "read the calls before a page"
        docs = await self._of_standing(
            conversation_id, user_id, partial(read, {}), step, absent_is_empty=True, life=life,
            again=read,
        )  # fmt: skip
        return [validated[doc["_id"]] for doc in docs or ()]

    async def _paired_calls(
        self,
        scope: dict[str, Any],
        needed: Counter[str],
        before_seq: int,
        validated: dict[Any, AgentMessage],
        life: Mapping[str, Any],
    ) -> list[dict[str, Any]]:
        """`calls_before`'s scan of the messages below `before_seq` in `scope` and `life` (a
        filter: `_of_life`, or none), by `seq`; each kept validated once, into `validated` by
        `_id`. Every message read that takes part in the pairing is among those it returns, so
        a scan that met another life's (`_its_messages` leaves some out) is read again."""
        found: list[tuple[dict[str, Any], AgentMessage]] = []
        reach: dict[str, int] = {}
        below = before_seq
        while len(reach) < len(needed):
            wanted = sorted(set(needed) - set(reach))
            either = [{"tool_calls.id": {"$in": wanted}}, {"tool_call_id": {"$in": wanted}}]
            query = {**scope, **life, "seq": {"$lt": below}, "$or": either}
            cursor = self._messages.find(query).sort("seq", -1).limit(PAGE_FIRST_BATCH)
            docs = await cursor.to_list(None)
            found += zip(docs, messages_adapter.validate_python(docs), strict=True)
            stretch = [m for _, m in reversed(found)]
            reach |= _reached(stretch, {call_id: needed[call_id] for call_id in wanted})
            if len(docs) < PAGE_FIRST_BATCH:
                break
            below = docs[-1]["seq"]
        kept = [(doc, message) for doc, message in reversed(found) if _kept(message, reach)]
        validated.update((doc["_id"], message) for doc, message in kept)
        return [doc for doc, _ in kept]

    async def messages_page(
        self,
        conversation_id: str,
        *,
        after: str | None = None,
        limit: int = 20,
        order: SortOrder = "asc",
        user_id: str | None = None,
    ) -> MessagePage:
        """A page of messages by `seq`, starting after the message id `after` (one a pop
        removed: from its `seq`, where what came after it was logged, `_seq_of`)."""
        limit = _page_size(limit)
        if order not in ("asc", "desc"):
            raise InvalidInput(f"invalid order {order!r}: use 'asc' or 'desc'")
        query: dict[str, Any] = {
            "conversation_id": validate_identifier(conversation_id, "conversation_id")
        }
        if user_id is not None:
            query["user_id"] = validate_identifier(user_id, "user_id")
        cursor_epoch = None
        if after is not None:
            try:
                seq, removed, cursor_epoch = await self._seq_of(after, query)
            except InvalidInput as unknown:
                return await self._page_after_unknown(conversation_id, after, limit, order,
                                                      user_id, unknown)  # fmt: skip
            query["seq"] = {"$gt": seq - removed} if order == "asc" else {"$lt": seq}
        read_at = utc_now()  # before the messages are read: the time their holes are judged at
        docs, has_more, seen = await self._page_read(conversation_id, query, order, limit, user_id)
        if docs is not None and seen is not None and _another_life(seen, cursor_epoch):
            raise _cursor_of_another_life(conversation_id, str(after))
        if docs is None:  # not migrated yet (no document, or one being migrated), or none
            legacy = await self._legacy_page(conversation_id, after, limit, order, user_id)
            if legacy is not None:
                return legacy
            if after is not None:  # a message the fallback does not serve: NotFound, else 422
                await self._legacy(conversation_id, user_id)
                raise InvalidInput(f"invalid after: message {after!r} is not in this conversation")
            raise NotFound(f"conversation {conversation_id!r} was not found")
        if order == "asc":
            first = query["seq"]["$gt"] + 1 if after is not None else 0
            docs, pending = await self._committed(query["conversation_id"], docs, first, read_at)
        else:
            top = query["seq"]["$lt"] - 1 if after is not None else None
            docs, pending = await self._committed_down(
                query["conversation_id"], docs, top, has_more, read_at
            )
        messages = messages_adapter.validate_python(docs)
        return MessagePage(
            data=messages,
            has_more=has_more or pending is not None,
            first_id=messages[0].id if messages else None,
            last_id=messages[-1].id if messages else None,
            pending_seq=pending,
        )

    async def _page_read(
        self,
        conversation_id: str,
        query: dict[str, Any],
        order: SortOrder,
        limit: int,
        user_id: str | None,
    ) -> tuple[list[dict[str, Any]] | None, bool, Mapping[str, Any] | None]:
        """A page of `query` read at once with the conversation document in the caller's scope:
        the messages it serves (`_its_messages`), whether more follow, and the document. A page
        a late insert of another life thinned is read again with the conversation's life in
        its query (`_of_life`, one round trip more): it holds as many as it asks for."""
        page = partial(_bounded_page, self._messages, query, None, *_by_seq(order), limit)
        with storage_errors("read messages"):
            (read, has_more), found = await _at_once(page, partial(self._in_scope, conversation_id))
        seen = _scoped(found, user_id)
        docs = _its_messages(conversation_id, seen, read)
        if docs is not None and seen is not None and len(docs) < len(read):
            of_life = {**query, **_of_life(seen)}
            with storage_errors("read messages"):
                docs, has_more = await _bounded_page(
                    self._messages, of_life, None, *_by_seq(order), limit
                )
        return docs, has_more, seen

    async def _committed(
        self, conversation_id: str, docs: list[dict[str, Any]], first: int, read_at: datetime
    ) -> tuple[list[dict[str, Any]], int | None]:
        """The page up to the first `seq` a turn still being written holds, and that `seq`.

        Turns commit out of `seq` order (reserve, then insert), so a `seq` missing
        below a stored one may still arrive. It is waited for while the turn that
        reserved it is younger than `TurnRules.abandon_after`, and passed after; a
        `seq` a pop removed is passed at once (`Gaps.passed`). The age is the block's at
        `read_at`, the reader's clock read before the messages `docs` were: a reader slow
        between that read and the lookup passes no turn that landed meanwhile. Costs one
        lookup of the conversation, only when the page has a hole.
        """
        expected, gaps = first, None
        for index, doc in enumerate(docs):
            if doc["seq"] != expected:
                if gaps is None:
                    gaps = await self._gaps(conversation_id)
                missing = range(expected, int(doc["seq"]))
                writing = gaps.written(
                    missing, now=read_at, abandon_after=self._rules.abandon_after
                )
                if writing is not None:
                    return docs[:index], writing
            expected = doc["seq"] + 1
        return docs, None

    async def _of_standing(
        self,
        conversation_id: str,
        user_id: str | None,
        read: Callable[[], Awaitable[list[dict[str, Any]]]],
        step: str,
        *,
        absent_is_empty: bool = False,
        life: Conversation | None = None,
        again: Callable[[Mapping[str, Any]], Awaitable[list[dict[str, Any]]]] | None = None,
        being_migrated: bool = False,
    ) -> list[dict[str, Any]] | None:
        """The messages `read` reads, read at once with the conversation document in the
        caller's scope (two commands, one wait), as that document serves them
        (`_its_messages`): NotFound for one that is no conversation, None for none; with
        `absent_is_empty`, none for either, as for a conversation that does not exist. With
        `life` (the conversation as the caller read it before), NotFound unless the document
        is that conversation still (`_another_life`), so no read pairs one conversation's
        summary with the messages of another started under its id since. With `again` (the
        same read of a window, its query narrowed by a filter), a window another life's late
        insert thinned is read again with the conversation's life in its query (`_of_life`).
        With `being_migrated`, one a migration run is writing serves the messages it stored so
        far (`_its_messages`)."""
        with storage_errors(step):
            docs, found = await _at_once(read, partial(self._in_scope, conversation_id))
        found = _scoped(found, user_id)
        if life is not None and (
            found is None
            or not is_standing(found)
            or _another_life(found, life.epoch, life.created_at)
        ):
            raise NotFound(f"conversation {conversation_id!r} was not found")
        serves = is_listed if being_migrated else is_standing
        if absent_is_empty and (found is None or not serves(found)):
            return []
        kept = _its_messages(conversation_id, found, docs, being_migrated=being_migrated)
        if again is None or kept is None or found is None or len(kept) == len(docs):
            return kept
        with storage_errors(step):
            return of_epoch(await again(_of_life(found)), found.get("epoch"))

    def _in_scope(self, conversation_id: str) -> Awaitable[Any]:
        """The conversation document under the id, as much as tells whether it is one
        (`is_standing`), its `epoch` and owner: the driver's awaitable. Read by id whoever's it
        is, so that one a delete marked or a fork not made yet makes the read fallback
        NotFound to every caller (`refuse_unless_fallback_serves`); `_scoped` tells what of it
        the caller sees."""
        scope = self._scope(conversation_id, None)
        found: Awaitable[Any] = self._conversations.find_one(scope, _STANDING_READ)
        return found

    async def _committed_down(
        self,
        conversation_id: str,
        docs: list[dict[str, Any]],
        top: int | None,
        more: bool,
        read_at: datetime,
    ) -> tuple[list[dict[str, Any]], int | None]:
        """`_committed` for a page newest first, from `seq` `top` down (from its first message
        without `after`: what is written above it later is newer than the page): the page down
        to the first `seq` a turn still being written holds below a stored one, or, the page
        ending the conversation, below its last message; and that `seq`. Judged at `read_at`,
        as `_committed` judges."""
        expected, gaps = (docs[0]["seq"] if top is None and docs else top), None
        bottoms = [int(doc["seq"]) for doc in docs] + ([] if more else [-1])
        for index, seq in enumerate(bottoms):
            if expected is not None and seq != expected:
                if gaps is None:
                    gaps = await self._gaps(conversation_id)
                missing = range(expected, seq, -1)
                writing = gaps.written(
                    missing, now=read_at, abandon_after=self._rules.abandon_after
                )
                if writing is not None:
                    return docs[:index], writing
            expected = seq - 1
        return docs, None

    async def _gaps(self, conversation_id: str) -> Gaps:
        with storage_errors("read the conversation's turns"):
            doc = await self._conversations.find_one(conversation_by_id(conversation_id), GAPS_READ)
        return Gaps.of(doc)

    async def _legacy_page(
        self,
        conversation_id: str,
        after: str | None,
        limit: int,
        order: SortOrder,
        user_id: str | None,
    ) -> MessagePage | None:
        """A page of a not yet migrated conversation, or None if it has no legacy turns."""
        try:
            messages = (await self._legacy(conversation_id, user_id)).messages
        except NotFound:
            return None
        if order == "desc":
            messages = messages[::-1]
        if after is not None:
            ids = [m.id for m in messages]
            if after not in ids:
                return None
            messages = messages[ids.index(after) + 1 :]
        page = messages[:limit]
        return MessagePage(
            data=page,
            has_more=len(messages) > limit,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
        )

    async def _page_after_unknown(
        self,
        conversation_id: str,
        after: str,
        limit: int,
        order: SortOrder,
        user_id: str | None,
        unknown: InvalidInput,
    ) -> MessagePage:
        """The page after `after`, which no stored message of the conversation is (`unknown`
        says so): a legacy conversation's page; else NotFound when the caller sees no such
        conversation (deleted since the id was read, or another user's), as a page without
        `after` would be; else `unknown` (one lookup more, on this path only)."""
        if after.startswith("msg-"):
            legacy = await self._legacy_page(conversation_id, after, limit, order, user_id)
            if legacy is not None:
                return legacy
        if not await self._visible(conversation_id, user_id):
            await self._legacy(conversation_id, user_id)  # NotFound when it has none either
        raise unknown

    async def _visible(self, conversation_id: str, user_id: str | None) -> bool:
        """Whether the conversation document exists and the caller sees it (`_scope`): one
        lookup, made only where a read found nothing to tell a missing conversation by."""
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                self._standing(conversation_id, user_id), {"_id": 1}
            )
        return found is not None

    async def _seq_of(self, message_id: str, query: dict[str, Any]) -> tuple[int, bool, str | None]:
        """The `seq` of the message `message_id` of the conversation `query` names, whether
        a pop removed it (one more lookup, of the conversation's `popped_messages` and its
        pop under way, only when it is not stored; one older than the newest
        `POPPED_MESSAGES_KEPT` is InvalidInput), and the `epoch` of the life it was stored in
        (None when it is not stored, or was stored before epochs), which the page read after
        it must be of (`_another_life`).

        A pop under way (its mark, `popping`, names the message and its `seq`) counts as its
        record: its message is deleted before the update that lists it in `popped_messages`
        clears the mark, in one write, so the lookup finds it in one or the other, whether
        that update is on its way or was lost (until a later write or read finishes the pop).

        For a removed message, the lowest `seq` its pop and every later finished one gave
        back (`_read_on_from`: a message popped twice, from its earliest removal listed): what
        a pop gave its `seq` back to was logged after the message it removed, and a reader
        that had read that message had read the ones below it that later pops removed (a
        turn regenerated whole: its answer popped, then its question)."""
        message_id = validate_identifier(message_id, "after")
        with storage_errors("find the cursor message"):
            read = {"seq": 1, "epoch": 1}
            doc = await self._messages.find_one({"_id": message_id, **query}, read)
            if doc is not None:
                return int(doc["seq"]), False, doc.get("epoch")
            scope: dict[str, Any] = {
                **conversation_by_id(query["conversation_id"]),
                "$or": [{"popped_messages.i": message_id}, {"popping.message_id": message_id}],
            }
            if "user_id" in query:
                scope["user_id"] = query["user_id"]
            conversation = await self._conversations.find_one(
                scope, {"popped_messages": 1, "popping.message_id": 1, "popping.seq": 1}
            )
        seq = _read_on_from(conversation or {}, message_id)
        if seq is None:
            raise InvalidInput(f"invalid after: message {message_id!r} is not in this conversation")
        return seq, True, None

    # -- human in the loop -----------------------------------------------------------

    async def pending_hitl(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> PendingHitl | None:
        """The conversation's unresolved HITL prompt, whole, in one lookup.

        A prompt whose message was cut to bound it (its params or question: the copy on the
        conversation lists them in `truncated`) is read back whole from its message and
        GridFS, in three lookups more, as `with_full_texts` reads; a field whose whole text
        is not found stays cut and listed in `truncated`.
        """
        doc = await self._summary(
            conversation_id, user_id, {"pending_hitl": 1, "epoch": 1}, "read the pending prompt"
        )
        if doc is None:
            return (await self._legacy(conversation_id, user_id)).conversation.pending_hitl
        pending = doc.get("pending_hitl")
        if not pending:
            return None
        prompt = PendingHitl.model_validate(pending)
        if not seems_cut(prompt):
            return prompt
        return await self._whole_prompt(conversation_id, doc.get("epoch"), prompt)

    async def _whole_prompt(
        self, conversation_id: str, epoch: str | None, prompt: PendingHitl
    ) -> PendingHitl:
        """The prompt with its cut fields read back whole from its message (as it is when
        the message is gone)."""
        query = {
            "_id": prompt.message_id,
            "conversation_id": conversation_id,
            "epoch": {"$in": [None, epoch]},
        }
        with storage_errors("read the pending prompt"):
            found = await self._messages.find_one(query)
        if found is None:
            return prompt
        [message] = await self.with_full_texts([message_adapter.validate_python(found)])
        return whole_prompt(prompt, message)

    async def pending_calls(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> list[PendingCall]:
        """The conversation's tool calls awaiting an answer from a later turn, in one lookup.

        Pass them to the stream builders (`pending=`) so a later turn's
        result or denial can answer them. A conversation that does not exist
        yet (or is not the user's) awaits nothing: the list is empty.
        """
        read = {"pending_calls": 1, "resolved_hitl": 1, "approved_calls": 1}
        doc = await self._summary(conversation_id, user_id, read, "read the pending calls")
        if doc is None:
            return []
        calls = awaiting_results(
            doc.get("pending_calls") or (),
            doc.get("resolved_hitl") or (),
            doc.get("approved_calls") or (),
        )
        return [PendingCall.model_validate(call) for call in calls]

    async def resolve_hitl(
        self,
        conversation_id: str,
        request_id: str,
        *,
        user_id: str | None = None,
        call_ids: Sequence[str] | None = None,
        calls: Sequence[PendingCall | Mapping[str, Any]] | None = None,
        or_unowned: bool = False,
    ) -> None:
        """Record a person's answer to the prompt `request_id`: Conflict if no prompt of that id
        is pending, holds back a pending call, or was resolved before. `user_id`: in that
        user's conversation only, or with `or_unowned` an unowned one too, as a turn a service
        logs naming that user may write (`log_streamed_turn`); else NotFound.

        The prompt is cleared if it is the pending one, and its request id remembered
        (`resolved_hitl`), so the calls it holds await their results (`pending_calls` serves
        them with `request_id: null`), also when another prompt is the pending one. A request's
        first answer is its answer: resolving it again (a retry whose first reply was lost,
        another tab) answers as the first call did and writes nothing (one lookup more, then
        only). The calls the prompt held stay released (a denial of one is refused).

        `calls` are the calls the answer concerns, as the answering client read them
        (`pending_calls`: each a `PendingCall`, or a mapping holding its `tool_call_id` and
        `message_id`; `log_streamed_turn` passes those each prompt held in the turn's
        `pending`): the prompt is resolved only while it holds one of them not released yet
        (or, holding none, is the pending one not asked again since one of them was made, and
        each one made here: a lookup of their messages, then a second update), and only those
        are released: a call another prompt of the id holds stays held until an answer names
        it (or names none); the id is remembered once none of its calls is left unreleased.
        An answer read before a later prompt asked under the same request id does not answer
        that one, even about a call of the same id or holding no call: Conflict, or, when
        the calls it names were released by an answer to a prompt of that id, an answer as
        the first one's. Once the id is resolved, an answer naming a call no answer of the
        id released (a call a turn denied, another prompt's) is refused as before.
        `call_ids` name the calls by their ids only: a later call of the same id is taken
        for the one read. A prompt holding a call listed again: `_resolution_recorded`.
        It records the prompts of the id stored as it came (`_stored_below`, one lookup).
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput("request_id must be a non-empty string")
        request_id = storable(request_id, "request_id")
        concerns = concerned_calls(call_ids, calls)
        scope = self._scope(conversation_id, user_id, or_unowned=or_unowned)
        stored_below = await self._stored_below(conversation_id, request_id)
        query, update = resolution(request_id, concerns, stored_below=stored_below)
        doc = await self._resolution_recorded(scope, query, update, request_id)
        if doc == {}:
            return await self._resolved_in_legacy(conversation_id, request_id)
        if doc is None:  # NotFound, or legacy turns not migrated yet: read-only
            await self._refuse_unmigrated(conversation_id, user_id, "answered")
        assert doc is not None  # else `_refuse_unmigrated` raised
        # Before any replay of an answer, as for a turn.
        refuse_unless_standing(conversation_id, doc, f"the answer to {request_id!r}")
        # Resolved before, its first answer standing, or answered by `_answer_unheld`: its
        # dual write (again, for a retry whose first attempt failed after the answer).
        if not answered_before(doc, request_id, concerns):
            answer = (request_id, concerns, stored_below)
            await self._answer_unheld(scope, conversation_id, answer, doc)
        return await self._resolved_in_legacy(conversation_id, request_id)

    async def _stored_below(self, conversation_id: str, request_id: str) -> int:
        """One past the `seq` of the newest prompt of `request_id` stored in the conversation
        (0: none), as an answer to it reads before it is recorded
        (`AnsweredPrompt.stored_below`): one `find_one` down the `{conversation_id, seq}`
        index from its end."""
        query = {"conversation_id": conversation_id, "hitl_action.request_id": request_id}
        with storage_errors("read the prompt answered"):
            found = await self._messages.find_one(query, {"seq": 1}, sort=[("seq", -1)])
        seq = None if found is None else found.get("seq")
        return seq + 1 if isinstance(seq, int) else 0

    async def _resolution_recorded(
        self,
        scope: dict[str, Any],
        query: dict[str, Any],
        update: list[dict[str, Any]],
        request_id: str,
    ) -> dict[str, Any] | None:
        """`resolve_hitl`'s answer (`query`, `update`) recorded while no call is marked listed
        again (`RELISTED`): `{}`. Matching nothing, the conversation read (`_PROMPTS_READ`;
        None: gone), and, a fold of its pending state owed or a block it watches landed
        (`_refolded`: a turn whose writer died before its fold asked the prompt), the fold
        written and the answer recorded again, once; one marking calls listed again: those
        the prompt holds are looked at (`_relocated.looked_again`: a call whose answer
        landed goes off the list with the prompt it clears, by the fold the landed turn
        owed, else the take-off, and the answer is refused as one to a prompt no longer
        pending; the others' marks go), and the answer is recorded again while none of them
        is marked: `{}` when it was, else the conversation read again. A read, a `find` and
        an update more, on that path only."""
        unmarked = scope | query | STANDING | NONE_RELISTED
        for attempt in range(2):
            with storage_errors("resolve the pending prompt"):
                if (await self._conversations.update_one(unmarked, update)).matched_count:
                    return {}
            doc = await self._prompts_read(scope)
            if attempt or doc is None or not await self._refolded(doc):
                break
        if doc is None or not doc.get(RELISTED):
            return doc
        marked = relisted_held(doc, request_id)
        await looked_again(
            self._conversations,
            self._messages,
            doc,
            marked,
            abandon_after=self._rules.abandon_after,
            name_chars=self._rules.name_chars,
        )
        marks = [{RELISTED: {"$elemMatch": {"c": c, "m": m}}} for c, m in marked]
        with storage_errors("resolve the pending prompt"):
            result = await self._conversations.update_one(
                with_none_of(scope | query | STANDING, *marks), update
            )
        return {} if result.matched_count else await self._prompts_read(scope)

    async def _prompts_read(self, scope: dict[str, Any]) -> dict[str, Any] | None:
        """The conversation `scope` names, as an answer to a prompt that matched nothing
        reads it to tell why (`_PROMPTS_READ`)."""
        with storage_errors("read the pending prompt"):
            found: dict[str, Any] | None = await self._conversations.find_one(scope, _PROMPTS_READ)
        return found

    async def _answer_unheld(
        self,
        scope: dict[str, Any],
        conversation_id: str,
        answer: tuple[str, Sequence[CallKey] | None, int],
        doc: Mapping[str, Any],
    ) -> None:
        """Answer the pending prompt `request_id` holding no call, which `resolution` leaves
        to this check when the answer names calls, only when it was not asked again since
        one of them was made (`_asked_after`), and that very prompt (its message), so one
        asked meanwhile is not answered, nor by calls named by an identity no message of the
        conversation made (read in a fork, or never made: `None`); else the Conflict saying
        why the answer `resolve_hitl` read the conversation `doc` for matched nothing.
        `answer`: its request id, the calls it concerns and how far the prompts of the id
        stored as it came reach (`AnsweredPrompt.stored_below`)."""
        request_id, concerns, stored_below = answer
        raw = doc.get("pending_hitl")
        pending = PendingHitl.model_validate(raw) if raw else None
        open_calls = awaiting_results(
            doc.get("pending_calls") or (),
            doc.get("resolved_hitl") or (),
            doc.get("approved_calls") or (),
        )
        held = [c for c in open_calls if c.get("request_id") == request_id]
        asked = pending if pending and pending.request_id == request_id else None
        again = await self._asked_after(conversation_id, asked, concerns)
        if asked is not None and concerns is not None and again is False and not held:
            query, update = resolution(
                request_id, concerns, asked=asked.message_id, stored_below=stored_below
            )
            with storage_errors("resolve the pending prompt"):
                result = await self._conversations.update_one(scope | query | STANDING, update)
            if result.matched_count:
                return
        raise _not_resolvable(conversation_id, request_id, pending, held, bool(again))

    async def _asked_after(
        self, conversation_id: str, pending: PendingHitl | None, concerns: Sequence[CallKey] | None
    ) -> bool | None:
        """Whether the `pending` prompt asks its request id again since one of the calls
        `concerns` names was made (by that very message when it is named): a prompt of the
        id was asked between that call and it, so an answer read then was read before this
        question. A prompt asked once, after the call, was not asked again. None when a
        call named by its identity (its message) was never made in this conversation: the
        answer concerns no call of its (API.md: a 409). One lookup of the prompt's message,
        two more if stored."""
        if pending is None or not concerns:
            return False
        with storage_errors("read the pending prompt"):
            prompt = await self._messages.find_one({"_id": pending.message_id}, {"seq": 1})
            if prompt is None or prompt.get("seq") is None:
                return False
            made = [{"tool_calls.id": c, **({} if m is None else {"_id": m})} for c, m in concerns]
            query: dict[str, Any] = {"conversation_id": conversation_id, "$or": made}
            by_identity = any(m is not None for _, m in concerns)  # one message each: all
            if not by_identity:
                query["seq"] = {"$lt": prompt["seq"]}
            found = await self._messages.find(
                query,
                {"seq": 1, "tool_calls.id": 1},
                sort=[("seq", -1)],
                limit=int(not by_identity),
            ).to_list(None)
            if not _made_by(found, concerns):
                return None
            found = [d for d in found if isinstance(d.get("seq"), int) and d["seq"] < prompt["seq"]]
            if not found:
                return False
            between = {"$gt": found[0]["seq"], "$lt": prompt["seq"]}
            asked = {"conversation_id": conversation_id, "seq": between}
            asked["hitl_action.request_id"] = pending.request_id
            return await self._messages.find_one(asked, {"_id": 1}) is not None

    async def _resolved_in_legacy(self, conversation_id: str, request_id: str) -> None:
        """The answer's dual write (`LegacySource.prompt_resolved`): its legacy prompt marked
        resolved (the owner's, never another user's of the same request id), so a rollback
        keeps it answered (three more round trips with the dual write on, none without)."""
        if self._legacy_source is not None:
            await self._legacy_source.prompt_resolved(conversation_id, request_id)

    # -- search ----------------------------------------------------------------------

    async def search(
        self,
        text: str,
        *,
        user_id: str | None = None,
        conversation_id: str | None = None,
        limit: int = 20,
    ) -> list[SearchHit]:
        """Messages matching `text`, best first, within one user's or one conversation's: the
        first page of `search_page` (fewer than `limit` when they pass `PAGE_BYTES`)."""
        page = await self.search_page(
            text, user_id=user_id, conversation_id=conversation_id, limit=limit
        )
        return page.data

    async def search_page(
        self,
        text: str,
        *,
        user_id: str | None = None,
        conversation_id: str | None = None,
        limit: int = 20,
        cursor: str | None = None,
    ) -> SearchPage:
        """A page of the messages matching `text`, best first, within one user's or one
        conversation's: `limit` at most, fewer when they pass `PAGE_BYTES` (one at least);
        `next_cursor` (passed as `cursor`) reads on, ranked from where this page ended. Only
        messages of a conversation standing under its id, of their epoch, and the scope's
        owner's are served (`_served_by_search`: one read more on a page with hits), so a page
        may hold fewer, its ranks skipping what it left out."""
        limit = _page_size(limit)
        skipped = 0 if cursor is None else decode_search_cursor(cursor)
        query = await self._search_query(text, user_id, conversation_id)
        # Sorting by the text score needs no projection of it (MongoDB 4.4+); projecting it
        # would also trim documents on some MongoDB-compatible servers. `_id` orders ties
        # the same way on every page.
        ranked = [("score", {"$meta": "textScore"}), ("_id", 1)]

        async def read(size: int, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
            found = self._messages.find(query).sort(ranked).skip(skipped + len(kept))
            docs: list[dict[str, Any]] = await found.limit(size).to_list(None)
            return docs

        with storage_errors("search messages"):
            docs, has_more = await bounded_read(read, limit)
        served = await self._served_by_search(docs, query["user_id"])
        hits = [
            SearchHit(message=message_adapter.validate_python(d), rank=rank)
            for rank, d in enumerate(docs, start=skipped + 1)
            if d["_id"] in served
        ]
        after = skipped + len(docs)
        return SearchPage(
            data=hits,
            has_more=has_more,
            next_cursor=encode_search_cursor(after) if has_more else None,
        )

    async def _served_by_search(self, docs: list[dict[str, Any]], owner: str | None) -> set[Any]:
        """The ids of the found messages `docs` whose conversation is under its id, of the
        message's epoch and owned by `owner` (the searching scope's owner): a late insert of a
        conversation deleted, erased or claimed since (its writer gone before it could take
        it back) is never served. One read of the page's conversations, on pages with hits
        only."""
        if not docs:
            return set()
        ids = list({d["conversation_id"] for d in docs})
        with storage_errors("search messages"):
            found = await self._conversations.find(
                {"_id": {"$in": ids}, **self._listed}, {"user_id": 1, "epoch": 1}
            ).to_list(None)
        standing = {c["_id"]: c for c in found if c.get("user_id") == owner}
        return {
            d["_id"]
            for d in docs
            if d["conversation_id"] in standing
            and d.get("epoch") in (None, standing[d["conversation_id"]].get("epoch"))
        }

    async def _search_query(
        self, text: str, user_id: str | None, conversation_id: str | None
    ) -> dict[str, Any]:
        """The filter of a search for `text` in its scope, refused when it finds nothing."""
        text = collapse_whitespace(text)
        if not text or len(text) > MAX_SEARCH_QUERY_CHARS:
            raise InvalidInput(
                f"invalid search: the query must have 1 to {MAX_SEARCH_QUERY_CHARS} characters"
            )
        found, excluded = search_words(text)
        if not found:
            raise InvalidInput(
                "invalid search: the query needs at least one word to find, not only words "
                "excluded with '-'"
                if excluded
                else "invalid search: the query holds no word to search for (a word holds a "
                "letter or a digit)"
            )
        if user_id is None and conversation_id is None:
            raise InvalidInput("invalid search: scope it to a user_id or a conversation_id")
        query: dict[str, Any] = {"$text": {"$search": text}}
        if conversation_id is not None:
            query["conversation_id"] = validate_identifier(conversation_id, "conversation_id")
        if user_id is not None:
            query["user_id"] = validate_identifier(user_id, "user_id")
        else:
            # The text index is compound on `user_id` first: every search names the owner,
            # so it reads one user's postings, never the whole collection's.
            query["user_id"] = await self._owner_of(query["conversation_id"])
        return query

    async def _owner_of(self, conversation_id: str) -> str | None:
        with storage_errors("read the conversation"):
            doc = await self._conversations.find_one(
                conversation_by_id(conversation_id) | self._listed, {"user_id": 1}
            )
        if doc is None:
            raise NotFound(f"conversation {conversation_id!r} was not found")
        owner: str | None = doc.get("user_id")
        return owner

    # -- per user --------------------------------------------------------------------

    async def erase_user(self, user_id: str) -> Deleted:
        """Delete every conversation and message of a user. Re-runnable after a crash.

        Every message of the user's conversations goes, of each one's life (its `epoch`),
        whatever user it names (the user; none, logged before a turn assigned the conversation
        to the user, whose move to the user did not happen yet; the old id of a claim that
        moved the conversation to the user and not yet its messages), with the full texts of
        cut ones and what integrations keep beside the conversations (`THREAD_COLLECTIONS`:
        LangGraph checkpoints) of their lives or in the user's name: the user's
        conversations' documents beside them and messages first, `CLAIM_CHUNK`
        conversations per command, each chunk looked up again first (a conversation
        deleted meanwhile, its id perhaps taken by anyone, is left out; one claimed before its
        mark took is not the erasure's), then the documents of the conversations it found
        and marked, then every message naming the user outside
        the conversations the user holds by then (`_erase_strays`: late inserts of the erased
        ones, messages of no conversation or of another's), and, when a reserved `seq` held
        no message, those once more `TurnRules.claim_grace` later, with the messages of the
        erased conversations' lives no conversation holds, whatever user they name (a turn
        reserved under the old id of a claim, inserting late: `_erase_lives`, as a delete
        finding no conversation sweeps its id). Each sweep takes messages by
        their conversation's `epoch`: a conversation the user starts while the erasure runs,
        under a new id or one it erased, is not the erasure's and keeps every message (and
        checkpoint: `_erase_stray_beside`).
        Erased, a conversation id exists nowhere. The conversations it erases are recorded
        first (`DeletionRecords`) and the records removed last: a repeated erasure first
        finishes the deletions of the user's conversations that failed once their documents
        went (after the grace, their messages, by epoch), and counts those messages.
        """
        user_id = validate_identifier(user_id, "user_id")
        finished = await self._deletions.finish({"user_id": user_id}, self._grace)
        legacy = 0
        if self._legacy_source is not None:
            legacy = await self._legacy_source.erase_user(user_id)
        with storage_errors("erase the user's data"):
            found = await self._conversations.find(
                {"user_id": user_id, **CONVERSATION_DOCUMENT}, LIFE_READ
            ).to_list(None)
        found = await self._deletions.record(found, user_id)
        messages, reserved = await self._erase_messages_of_conversations(user_id, found)
        messages += finished
        conversations = await self._erase_documents(user_id, found)
        late = await self._erase_strays(user_id)
        if messages < reserved:
            # A seq of the user's conversations reserved and not stored there: a turn may still
            # be inserting (as for a delete), under the user or, reserved before a claim moved
            # the conversation to the user, under the old id. Messages naming the user
            # elsewhere do not count.
            await self._grace()
            late += await self._erase_strays(user_id)
            late += await self._erase_lives(found)
        await self._erase_stray_beside(user_id)
        await self._deletions.done({"user_id": user_id})
        return Deleted(conversations=conversations, messages=messages + late, legacy_turns=legacy)

    async def _erase_messages_of_conversations(
        self, user_id: str, found: Sequence[Mapping[str, Any]]
    ) -> tuple[int, int]:
        """Delete the messages (and whole texts, and documents beside) of the conversations
        `user_id` owns (`found`, recorded), those of each conversation's life (its `epoch`, or
        none; beside, its thread's documents of its `created_at` or none named) whatever user
        they name (no owner: logged before a turn assigned the conversation; the old id of a
        claim that moved the conversation and not yet its messages), and every document
        beside their threads naming the user, `CLAIM_CHUNK` conversations per command; answer
        how many messages, and how many `seq`s those conversations reserved.

        Each chunk is looked up again right before its deletes (one round trip), each
        conversation as found, told by its `epoch` (`same_as_read`): one deleted since the
        first lookup, and perhaps started again under its id by anyone, the user too, is left
        out."""
        erased = reserved = 0
        mine = _one_of_or_none(user_id)
        for start in range(0, len(found), CLAIM_CHUNK):
            chunk = found[start : start + CLAIM_CHUNK]
            with storage_errors("erase the user's data"):
                held = await self._conversations.find(
                    {"$or": [same_as_read(d["_id"], d) for d in chunk], "user_id": user_id},
                    {"message_count": 1, **LIFE_READ},
                ).to_list(None)
            if not held:
                continue
            owned = [d["_id"] for d in held]
            reserved += sum(int(d.get("message_count") or 0) for d in held)
            lives = [thread_of(d) for d in held]
            await self._delete_beside(
                {"$or": [{"thread_id": {"$in": owned}, "user_id": mine}, *lives]},
                "erase the user's data",
            )
            with storage_errors("erase the user's data"):
                # Each conversation's messages by its epoch, whatever user they name (a claim
                # moves a conversation before its messages): a delete reaching the server late
                # takes nothing of one started again under the id since.
                erased += (await self._messages.delete_many(_lives_of(held))).deleted_count
            await self._full_texts.forget_conversations({d["_id"]: (d.get("epoch"),) for d in held})
        return erased, reserved

    async def _erase_lives(self, found: Sequence[Mapping[str, Any]]) -> int:
        """Delete the messages of the lives of the conversations the erasure found (`found`,
        erased) that no conversation holds, whatever user they name (`_sweep_strays`),
        `CLAIM_CHUNK` conversations per lookup. How many."""
        swept = 0
        for start in range(0, len(found), CLAIM_CHUNK):
            lives = _lives_of(found[start : start + CLAIM_CHUNK])
            swept += await self._sweep_strays(lives, "erase the user's data")
        return swept

    async def _erase_documents(self, user_id: str, found: Sequence[Mapping[str, Any]]) -> int:
        """Delete the documents of the conversations the erasure found (`found`, marked), still
        the user's, `CLAIM_CHUNK` per command, each told by its `epoch` (`same_as_read`): one
        started since under any id, by the user too, is not the erasure's. How many."""
        conversations = 0
        for start in range(0, len(found), CLAIM_CHUNK):
            chunk = found[start : start + CLAIM_CHUNK]
            with storage_errors("erase the user's data"):
                gone = await self._conversations.delete_many(
                    {"$or": [same_as_read(d["_id"], d) for d in chunk], "user_id": user_id}
                )
            conversations += int(gone.deleted_count)
        return conversations

    async def _erase_strays(self, user_id: str) -> int:
        """Delete the messages naming `user_id` that no conversation the user holds now holds,
        by their conversation's id and `epoch` (`_lives_of_no_conversation`): a late insert of
        a conversation erased (its epoch), messages of no conversation (logged before a
        document, the migration's, left by a deletion); those in the life of another user's
        conversation, a claim's not moved yet, go to that user (`_hand_over_claimed`). A
        conversation the user holds now (started since the erasure looked, under any id) keeps
        its messages, one started later too. Their whole texts go first. How many."""
        lives = await self._lives_of_no_conversation(
            {"user_id": user_id}, {"user_id": user_id}, "erase the user's data"
        )
        lives = await self._hand_over_claimed(user_id, lives)
        if not lives:
            return 0
        each = [{"conversation_id": c, "epoch": {"$in": list(e)}} for c, e in lives.items()]
        strays = {"user_id": user_id, "$or": each}
        await self._full_texts.forget(strays)
        with storage_errors("erase the user's data"):
            swept = await self._messages.delete_many(strays)
        return int(swept.deleted_count)

    async def _hand_over_claimed(
        self, user_id: str, lives: dict[str, set[str | None]]
    ) -> dict[str, set[str | None]]:
        """Of `lives` (messages naming `user_id` outside the user's conversations), give the
        ones of a conversation another user holds, of its life (its `epoch`, or none), to that
        user, and answer the others. Only a claim of `user_id` leaves them there: one still
        moving them, or cut short before it did, whose messages are the new owner's as its
        conversations are; the erasure finishes that move instead of deleting them. One round
        trip when `lives` names any conversation, and one per conversation handed over."""
        if not lives:
            return lives
        with storage_errors("erase the user's data"):
            claimed = await self._conversations.find(
                {
                    "_id": {"$in": list(lives)},
                    "user_id": {"$nin": [user_id, None]},
                    **CONVERSATION_DOCUMENT,
                },
                {"epoch": 1, "user_id": 1},
            ).to_list(None)
            for conversation in claimed:
                ours = lives[conversation["_id"]] & {conversation.get("epoch"), None}
                if not ours:
                    continue  # a late message of an earlier life under the id: a stray
                await self._messages.update_many(
                    {"conversation_id": conversation["_id"], "epoch": {"$in": list(ours)},
                     "user_id": user_id},
                    {"$set": {"user_id": conversation["user_id"]}},
                )  # fmt: skip
                lives[conversation["_id"]] -= ours
        return {c: epochs for c, epochs in lives.items() if epochs}

    async def _erase_stray_beside(self, user_id: str) -> None:
        """Delete the documents beside the conversations (`THREAD_COLLECTIONS`) naming
        `user_id` but those of the conversations the user holds now (started while the
        erasure ran, under any id: each told by its `epoch`, or, created before documents
        named it, by its `created_at` or none: `thread_of`), as `_erase_strays` leaves their
        messages; those of a conversation another user holds, of its life, a claim of the
        user not done moving, go to that user (`_hand_over_claimed_beside`). One round trip
        more than the deletes, and one per collection."""
        with storage_errors("erase the user's data"):
            held = await self._conversations.find(
                {"user_id": user_id, **CONVERSATION_DOCUMENT}, LIFE_READ
            ).to_list(None)
        kept = [thread_of(d) for d in held]
        await self._hand_over_claimed_beside(user_id, {d["_id"] for d in held})
        query: dict[str, Any] = {"user_id": user_id}
        if kept:
            query["$nor"] = kept
        await self._delete_beside(query, "erase the user's data")

    async def _hand_over_claimed_beside(self, user_id: str, held: set[str]) -> None:
        """Give the documents beside the conversations naming `user_id` in a thread another
        user's conversation holds, of its life (`thread_of`), to that user, as
        `_hand_over_claimed` gives their messages. One round trip per collection, one more when
        any names a thread outside `held`, and one per thread handed over."""
        with storage_errors("erase the user's data"):
            for collection in self._beside:
                threads = set(await collection.distinct("thread_id", {"user_id": user_id})) - held
                if not threads:
                    continue
                claimed = self._conversations.find(
                    {
                        "_id": {"$in": list(threads)},
                        "user_id": {"$nin": [user_id, None]},
                        **CONVERSATION_DOCUMENT,
                    },
                    {**LIFE_READ, "user_id": 1},
                )
                async for conversation in claimed:
                    await collection.update_many(
                        {**thread_of(conversation), "user_id": user_id},
                        {"$set": {"user_id": conversation["user_id"]}},
                    )  # fmt: skip

    async def _delete_beside(self, query: dict[str, Any], action: str) -> None:
        """Delete what `query` selects in each collection integrations keep beside the
        conversations (`THREAD_COLLECTIONS`): one command per collection."""
        with storage_errors(action):
            for collection in self._beside:
                await collection.delete_many(query)

    async def claim(self, from_user_id: str, to_user_id: str) -> Claimed:
        """Move every conversation and message of one user id to another.

        Conversations move first: a turn logged meanwhile takes its owner from
        the conversation document, so it is stamped with the new owner. Then the
        messages of the conversations the new owner holds move, and so do the
        documents integrations keep beside them in the old owner's name
        (`THREAD_COLLECTIONS`: LangGraph checkpoints, which the new owner's graphs
        then read) (`_move_claimed_messages`): a conversation the old owner starts
        between the two moves stays its own, with its messages. A turn reserved before, under
        the old owner, whose messages land after the messages moved is moved by a
        last sweep `TurnRules.claim_grace` later, or, slower than that, by its
        logger (`AgentMessageLogger.log_messages`). A fork of one of the old owner's
        conversations that read it before the conversations moved, and created its own after,
        follows its source to the new owner before it stands (`AgentMessageLogger.fork`). A
        conversation whose delete has begun (`NOT_BEING_DELETED`) stays the old owner's, whose
        delete run again finishes it.
        """
        from_user_id = validate_identifier(from_user_id, "from_user_id")
        to_user_id = validate_identifier(to_user_id, "to_user_id")
        if from_user_id == to_user_id:
            raise InvalidInput("invalid claim: the two user ids are the same")
        with storage_errors("claim the conversations"):
            conversations = await self._conversations.update_many(
                {"user_id": from_user_id, **NOT_BEING_DELETED, **CONVERSATION_DOCUMENT},
                {"$set": {"user_id": to_user_id, "legacy_user_id": None}},
            )
        messages = await self._move_claimed_messages(from_user_id, to_user_id)
        # Not migrated yet, or kept for rollback: they must follow their owner too, but those
        # of a conversation left to the old owner (a delete marked it), which stay with it.
        legacy = 0
        if self._legacy_source is not None:
            kept = await self._marked_of(from_user_id)
            legacy = await self._legacy_source.claim(from_user_id, to_user_id, kept=kept)
        late = 0
        if conversations.modified_count:
            await self._grace()
            late = await self._move_claimed_messages(from_user_id, to_user_id)
            # A claim of the new owner's own account, chained at once, may have moved a
            # conversation on just as these messages were handed to the new owner (counted).
            await self._hand_to_holders(to_user_id)
        return Claimed(
            conversations=conversations.modified_count,
            messages=messages + late,
            legacy_turns=legacy,
        )

    async def _marked_of(self, user_id: str) -> list[str]:
        """The ids of the user's conversations a delete marked (`DELETING`): those a claim
        leaves to the user, with everything of them. One round trip."""
        with storage_errors("claim the conversations"):
            marked = self._conversations.find(
                {"user_id": user_id, DELETING: {"$ne": None}, **CONVERSATION_DOCUMENT}
            )
            return [doc["_id"] for doc in await marked.to_list(None)]

    async def _move_claimed_messages(self, from_user_id: str, to_user_id: str) -> int:
        """Move to the new owner the messages, and the documents beside the conversations,
        still under the old owner in conversations the new owner holds (or a claim chained at
        once moved on: `_move_claimed`); answer how many messages. Run as the claim moved the
        conversations, and as its last sweep `claim_grace` later (a turn slower than that
        moves its own).

        Scoped to the conversations, not to the old owner: a conversation the old owner
        started after the claim moved the conversations stays its own, with its messages;
        one a turn created just as the claim started was moved with the others without
        being listed before. Which conversations is asked of the messages' conversation
        ids, `CLAIM_CHUNK` at a time, so each command stays small.
        """
        return await self._hand_to_holders(from_user_id) + await self._hand_over_unowned(to_user_id)

    async def _hand_to_holders(self, user_id: str) -> int:
        """The messages, and the documents beside them, naming `user_id` in conversations
        another user holds moved to that user (`_move_claimed`); answer how many messages."""
        moved = await self._move_claimed(self._messages, "conversation_id", _message_life, user_id)
        for collection in self._beside:
            await self._move_claimed(collection, "thread_id", thread_of, user_id)
        return moved

    async def _hand_over_unowned(self, to_user_id: str) -> int:
        """Move to `to_user_id` the messages naming no owner in the conversations it holds that
        a turn assigned an owner (`owned_from`): those logged before that turn, which it had
        not moved when it failed (its insert lost, or its move of them), as an erasure takes
        them for the owner's. Found by the conversations, not by a message naming the old
        owner: the assigning turn may have stored none. Only the messages of each
        conversation's own life move (its `epoch`, or none: stored before epochs were), never
        a late one of a conversation deleted under the id. Answer how many moved."""
        moved, lives = 0, []
        with storage_errors("claim the conversations"):
            assigned = self._conversations.find(
                {"user_id": to_user_id, "owned_from": {"$exists": True}}, {"epoch": 1}
            )
            async for conversation in assigned:
                life = {"$in": [conversation.get("epoch"), None]}
                lives.append({"conversation_id": conversation["_id"], "epoch": life})
                if len(lives) == CLAIM_CHUNK:
                    moved += await self._own_unowned(lives, to_user_id)
                    lives = []
            if lives:
                moved += await self._own_unowned(lives, to_user_id)
        return moved

    async def _own_unowned(self, lives: list[dict[str, Any]], to_user_id: str) -> int:
        """The messages naming no owner of the conversations' `lives` moved to `to_user_id`."""
        result = await self._messages.update_many(
            {"$or": lives, "user_id": None}, {"$set": {"user_id": to_user_id}}
        )
        return int(result.modified_count)

    async def _move_claimed(
        self,
        collection: Any,
        conversation_field: str,
        life_of: Callable[[Mapping[str, Any]], dict[str, Any]],
        from_user_id: str,
    ) -> int:
        """`_move_claimed_messages` in one collection whose documents name their conversation
        in `conversation_field`, those of a conversation's life as `life_of` selects them
        (`_message_life`, `thread_of`); answer how many documents moved.

        Each goes to the user holding its conversation now: the new owner, or whoever a claim
        chained at once (the new owner's own, between this claim's two moves) handed it to:
        a conversation holding documents of the old owner that another user holds is one a
        claim moved (the migration stamps a conversation's messages with its owner). Only
        its life's (its `epoch`, or none: written before epochs were), never a late one of a
        conversation deleted under the id and started again by someone else."""
        moved = 0
        with storage_errors("claim the conversations"):
            written = await collection.distinct(conversation_field, {"user_id": from_user_id})
            for start in range(0, len(written), CLAIM_CHUNK):
                held = self._conversations.find(
                    {
                        "_id": {"$in": written[start : start + CLAIM_CHUNK]},
                        "user_id": {"$nin": [from_user_id, None]},
                        **CONVERSATION_DOCUMENT,
                    },
                    {"user_id": 1, **LIFE_READ},
                )
                lives: dict[str, list[dict[str, Any]]] = {}
                async for conversation in held:
                    lives.setdefault(conversation["user_id"], []).append(life_of(conversation))
                for holder, of_holder in lives.items():
                    result = await collection.update_many(
                        {"$or": of_holder, "user_id": from_user_id}, {"$set": {"user_id": holder}}
                    )
                    moved += result.modified_count
        return moved

    async def export_user(
        self, user_id: str, *, full: bool = False
    ) -> AsyncIterator[ConversationExport]:
        """Every conversation of a user with its transcript, one at a time: what
        `stream_user_exports` streams, each conversation's messages held whole."""
        async for export in self.stream_user_exports(user_id, full=full):
            rest = [m async for batch in export.rest for m in batch]
            yield ConversationExport(conversation=export.conversation, messages=export.first + rest)

    async def stream_user_exports(
        self, user_id: str, *, full: bool = False
    ) -> AsyncGenerator[ExportStream, None]:
        """Every conversation of a user with its transcript, a batch of messages at a time (read
        each one's `rest` before asking for the next, which closes it).

        Each as listed (`stream_user_conversations`), with its messages as that summary counts
        them (`stream_transcript(life=…)`: those below its `message_count`, not a turn logged
        after it was listed), so that the summary holds for the messages it comes with. A pop
        since it was listed that removed one of them (a lookup after the first batch tells)
        pairs the conversation as read then with its messages read again, up to
        `EXPORT_READS` reads, else Conflict; so does a turn it counts still being written
        (reserved, not stored yet: `_unstored_turn`), read again `EXPORT_WAIT` later, else
        StorageUnavailable, nothing of that conversation yielded. A pop after the summary
        was paired is Conflict after the last batch (`stream_transcript`). One deleted,
        started again or claimed away before its turn is left out, the others follow. With
        `full`, fields cut to bound a message come whole (see `with_full_texts`). One round
        trip per conversation more than its streamed read (two when a turn younger than
        `abandon_after` lies past a first batch that is not its last: a first batch that is
        its last is judged by what it served, a turn stored since it was read read again).
        """
        user_id = validate_identifier(user_id, "user_id")
        async for conversation in self.stream_user_conversations(user_id):
            export = await self._export_stream(conversation, user_id, full)
            if export is None:
                continue  # gone since it was listed
            try:
                yield export
            finally:
                await export.rest.aclose()

    async def _export_stream(
        self, summary: Conversation, user_id: str, full: bool
    ) -> ExportStream | None:
        """The conversation as `summary` counts it, with its first batch of messages, once no
        pop since `summary` was read removed one of the messages it counts, and none of them
        is still being written (`_unstored_turn`; else read again as it stands then, while
        pops or writers do); None when it went since it was listed (deleted, started again,
        claimed away)."""
        writing: int | None = None
        for read in range(EXPORT_READS):
            if writing is not None:
                await pause(EXPORT_WAIT * 2 ** (read - 1))
            writing = None
            batches = self.stream_transcript(summary.id, user_id=user_id, life=summary)
            read_at = utc_now()  # before the first batch is read: its holes are judged then
            try:
                first = await anext(batches)  # the whole first batch: fewer, and it was the last
                now, gaps = await self._as_it_stands(summary, user_id)
                if now is not None and not now.popped_since(
                    summary.pops, summary.message_count - 1
                ):
                    last = len(first) < min(STREAM_FIRST_BATCH, STREAM_BATCH)
                    writing = await self._unstored_turn(summary, first, gaps, read_at, last=last)
                    settled = read == EXPORT_READS - 1
                    if writing is None:
                        exported = await self._exported(summary, first, batches, full, settled)
                        if exported is not None:
                            return exported
            except NotFound:
                now = None
            except BaseException:
                await batches.aclose()
                raise
            await batches.aclose()
            if now is None:
                return None
            summary = now
        if writing is not None:
            raise StorageUnavailable(
                f"conversation {summary.id!r} holds a turn still being written at seq {writing}, "
                f"at each of {EXPORT_READS} reads: its summary counts messages not stored yet "
                "(export again later)"
            )
        raise Conflict(
            f"conversation {summary.id!r} was popped while it was exported, at each of "
            f"{EXPORT_READS} reads: its summary could not be paired with its messages (export "
            "again)"
        )

    async def _exported(
        self,
        summary: Conversation,
        first: list[AgentMessage],
        batches: AsyncGenerator[list[AgentMessage], None],
        full: bool,
        settled: bool = True,
    ) -> ExportStream | None:
        """The conversation paired with its first batch, and the stream of its other batches,
        as `stream_transcript(full=full)` serves them: with `full`, each batch in parts, its
        cut fields whole (`_served`). None, `batches` closed, when a field of the first part
        stays cut, its whole text gone since the batch was read (a pop or a delete since the
        lookup): the caller reads the conversation again, unless `settled` (its last read)."""
        if not full:
            return ExportStream(conversation=summary, first=first, rest=batches)
        parts = self._served(first, full)
        try:
            head = await anext(parts)
        except BaseException:
            await parts.aclose()
            raise
        if not settled and _kept_whole_but_cut(head):
            await parts.aclose()
            await batches.aclose()
            return None
        return ExportStream(conversation=summary, first=head, rest=self._whole_rest(parts, batches))

    async def _whole_rest(
        self,
        parts: AsyncGenerator[list[AgentMessage], None],
        batches: AsyncGenerator[list[AgentMessage], None],
    ) -> AsyncGenerator[list[AgentMessage], None]:
        """The first batch's other `parts`, then each later batch's, cut fields whole."""
        try:
            async for part in parts:
                yield part
            async for batch in batches:
                async for part in self._served(batch, True):
                    yield part
        finally:
            await parts.aclose()
            await batches.aclose()

    async def _as_it_stands(
        self, summary: Conversation, user_id: str
    ) -> tuple[Conversation | None, Gaps]:
        """The conversation `summary` read as it stands now (once no pop is under way,
        `_summary`), read after its messages, with its `Gaps`: None when it went (deleted,
        started again, claimed away)."""
        life = same_conversation(summary.id, epoch=summary.epoch, created_at=summary.created_at)
        doc = await self._summary(
            summary.id, user_id, EXPORT_LOOKUP, "read the conversation", fence=self._listed | life
        )
        if doc is None:
            return None, Gaps()
        return Conversation.model_validate(doc), Gaps.of(doc)

    async def _unstored_turn(
        self,
        summary: Conversation,
        first: list[AgentMessage],
        gaps: Gaps,
        read_at: datetime,
        *,
        last: bool,
    ) -> int | None:
        """The first `seq` below `summary`'s `message_count` holding no message of its life
        that a turn is still writing (`Gaps.written`: reserved, counted, not stored yet,
        younger than `abandon_after`, as message pages wait for it); None when there is none.

        From the `first` batch served (`seq`s from 0). When it was the stream's `last`, every
        `seq` it did not serve is one no batch will: one a turn still writes, or stored since
        the batch was read (a turn that finished before the lookup `gaps` come from), is
        read again, no round trip more. Else past it only when a block younger than
        `abandon_after` is there: then one round trip reads which of its `seq`s hold a
        message (the batches after the first read those stored). A block's age is its age at
        `read_at`, the clock read before the `first` batch was: as a page judges it, a turn
        that landed after the batch was read is never passed."""
        written = partial(gaps.written, now=read_at, abandon_after=self._rules.abandon_after)
        count, served = summary.message_count, {m.seq for m in first}
        if last:
            return written(s for s in range(count) if s not in served)
        end = max((s for s in served if s is not None), default=-1) + 1
        hole = written(s for s in range(min(end, count)) if s not in served)
        if hole is not None or end >= count:
            return hole
        young = written(range(end, count))
        if young is None:
            return None
        query = {
            "conversation_id": summary.id,
            "epoch": _one_of_or_none(summary.epoch),
            "seq": {"$gte": young, "$lt": count},
        }
        with storage_errors("read the transcript"):
            docs = await self._messages.find(query, {"_id": 0, "seq": 1}).to_list(None)
        stored = {int(doc["seq"]) for doc in docs}
        return written(s for s in range(young, count) if s not in stored)

    @classmethod
    def _standing(cls, conversation_id: str, user_id: str | None) -> dict[str, Any]:
        """`_scope` for a read: only a conversation that is one (`STANDING`), never a document
        a delete marked or a fork not made yet, answered as missing."""
        return cls._scope(conversation_id, user_id) | STANDING

    @staticmethod
    def _scope(
        conversation_id: str, user_id: str | None, *, or_unowned: bool = False
    ) -> dict[str, Any]:
        """The filter of every read and write of one conversation's document: the one under
        the id (`user_id`'s, when named; with `or_unowned`, or no one's) that is a
        conversation document (`CONVERSATION_DOCUMENT`). A legacy turn standing under the id
        in `agent_conversations` (one a copy left there for text that is not valid UTF-8, or
        one an old-service writer logged) is none: the id is answered from its legacy turns,
        else NotFound, and no write of the store reaches that turn."""
        scope = conversation_by_id(validate_identifier(conversation_id, "conversation_id"))
        if user_id is not None:
            owner = validate_identifier(user_id, "user_id")
            scope["user_id"] = {"$in": [None, owner]} if or_unowned else owner
        return scope

    # -- streamed reads: memory bounded by a batch, not by the conversation ----------

    async def stream_transcript(
        self,
        conversation_id: str,
        *,
        user_id: str | None = None,
        batch_size: int = STREAM_BATCH,
        batch_bytes: int = STREAM_BATCH_BYTES,
        full: bool = False,
        life: Conversation | None = None,
    ) -> AsyncGenerator[list[AgentMessage], None]:
        """Every message of a conversation in `seq` order, a batch (one round trip) at a time.

        What `transcript` returns, without holding it whole: the first batch holds up
        to `STREAM_FIRST_BATCH` messages, each next one as many as fit in about `batch_bytes`
        by the size of the largest message so far, at most `batch_size`. A conversation with
        no messages here (empty, not migrated yet, missing, not `user_id`'s) is answered by
        `transcript` itself, as one batch or its error, first. With `full`, cut fields whole.

        One life of the conversation, the one under the id as the stream starts, or `life`
        (the conversation as read before, a listing's: its messages as it counts them, below
        its `message_count`): when more batches follow the first, every batch leaves out the
        messages of another `epoch`, and a lookup after the last one finds the conversation
        still there, the same one and `user_id`'s, its messages not being deleted, nor one
        served (of a `life`: it counts) popped since the first batch, else `Conflict` (what
        was served is not one transcript it had). A `life` gone before the first batch is
        NotFound, nothing served, as is one that is no conversation (`_its_messages`). The
        first batch is read at once with the conversation document (one wait); a round trip
        more than its batches for several (two when a `seq` past the last message is reserved).
        """
        if not 1 <= batch_size <= TRANSCRIPT_BATCH:
            raise InvalidInput(f"invalid batch_size {batch_size}: 1 to {TRANSCRIPT_BATCH}")
        scope = self._standing(conversation_id, user_id)
        pin = None if life is None else await self._life_named(scope, life)
        size, after, largest = min(STREAM_FIRST_BATCH, batch_size), -1, 1
        served: dict[int, str] = {}  # the ids of the newest messages served, by `seq`
        while True:
            first = after < 0
            if first:
                read, docs, pinned = await self._first_batch(scope, pin, size, user_id)
                if pinned is None:  # `transcript`'s answer: empty, legacy turns, or NotFound
                    async for part in self._served(await self._unstreamed(scope, pin), full):
                        yield part
                    return
                pin = pinned
            else:
                read, docs = await self._later_batch(scope, pin, after, size)
            assert pin is not None  # pinned by the first batch
            last = len(read) < size
            if read:
                after, largest = int(read[-1]["seq"]), max(map(_approximate_size, read))
            _remember_served(served, docs)
            if last and not first:
                await self._lived_through(scope, pin, after, served)
            if docs or first:
                async for part in self._served(messages_adapter.validate_python(docs), full):
                    yield part
            if last:
                return
            size = max(1, min(batch_size, batch_bytes // max(largest, 1)))

    async def _first_batch(
        self, scope: dict[str, Any], pin: dict[str, Any] | None, size: int, user_id: str | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None]:
        """A stream's first batch, read at once with the conversation as `transcript` reads
        it: the messages read, those served (`_its_messages`), and the life the stream serves
        (`pin`, or the conversation's as found); none when no message is served, for
        `_unstreamed` to answer."""
        with storage_errors("read the transcript"):
            read, found = await _at_once(
                partial(self._stream_batch, scope, pin, -1, size),
                partial(self._in_scope, scope["_id"]),
            )
        seen = _scoped(found, user_id)
        docs = _its_messages(scope["_id"], seen, read) or []
        if not docs or seen is None:
            return read, docs, None
        found = seen
        life = pin or {
            "epoch": found.get("epoch"),
            "created_at": found.get("created_at"),
            "pops": int(found.get("pops") or 0),
        }
        return read, docs, life

    async def _later_batch(
        self, scope: dict[str, Any], pin: dict[str, Any] | None, after: int, size: int
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A stream's batch after its first: the messages read, and those of the life it
        pinned (`epoch`) served."""
        read = await self._stream_batch(scope, pin, after, size)
        return read, of_epoch(read, (pin or {}).get("epoch"))

    async def _served(
        self, messages: list[AgentMessage], full: bool
    ) -> AsyncGenerator[list[AgentMessage], None]:
        """A streamed batch as served: as it is, or, with `full`, its cut fields whole, put
        back a part at a time (`parts_by_whole_text`, `FULL_TEXT_PART_CHARS`): a stream holds
        the whole texts of one part at once, never those of a whole batch (32 messages of
        15 MiB held 480 MiB per request)."""
        if not full:
            yield messages
            return
        for part in parts_by_whole_text(messages, FULL_TEXT_PART_CHARS):
            yield await self.with_full_texts(part)

    async def _stream_batch(
        self, scope: dict[str, Any], pin: dict[str, Any] | None, after: int, size: int
    ) -> list[dict[str, Any]]:
        """The next batch of a streamed transcript: up to `size` messages past `seq` `after`,
        of the life `pin` names (its `epoch`, or none) once the stream pinned one, below the
        `seq` it ends before (`end`) when it names one."""
        seqs: dict[str, Any] = {"$gt": after}
        query: dict[str, Any] = {"conversation_id": scope["_id"], "seq": seqs}
        if "user_id" in scope:
            query["user_id"] = scope["user_id"]
        if pin is not None:
            query["epoch"] = _one_of_or_none(pin.get("epoch"))
            if "end" in pin:
                seqs["$lt"] = pin["end"]
        with storage_errors("read the transcript"):
            docs: list[dict[str, Any]] = (
                await self._messages.find(query).sort("seq", 1).limit(size).to_list(None)
            )
        return docs

    async def _life_named(self, scope: dict[str, Any], life: Conversation) -> dict[str, Any]:
        """The life a stream serves when its caller read the conversation before (`life`):
        its `epoch`, or for one read before it had one, what it has now (a lookup; NotFound
        when it is gone); with what `life` counts: the `seq` its messages end before (`end`,
        its `message_count`) and the pops finished as read (`pops`)."""
        if life.id != scope["_id"]:
            raise InvalidInput(
                f"invalid life: it is conversation {life.id!r}, not {scope['_id']!r}"
            )
        counted = {"end": life.message_count, "pops": life.pops}
        if life.epoch is not None:
            return {"epoch": life.epoch, **counted}
        life_read = same_conversation(scope["_id"], epoch=None, created_at=life.created_at)
        query = self._as_listed(scope) | life_read
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(query, {"epoch": 1, "created_at": 1})
        if found is None:
            raise NotFound(f"conversation {scope['_id']!r} was not found")
        return {"epoch": found.get("epoch"), "created_at": found.get("created_at"), **counted}

    async def _unstreamed(
        self, scope: dict[str, Any], pin: dict[str, Any] | None
    ) -> list[AgentMessage]:
        """A stream whose first batch found no message: `transcript`'s answer (empty, the
        read fallback's, NotFound), or for a `life` named (a listing's), none while it is
        still there, or the read fallback's while the migration is writing it (`MIGRATING`,
        listed as `_listed` lists it), below the `seq` the life ends before (`end`)."""
        if pin is None:
            return await self.transcript(scope["_id"], user_id=scope.get("user_id"))
        life = same_as_read(scope["_id"], pin)
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                self._as_listed(scope) | life, {MIGRATING: 1}
            )
        if found is None:
            raise NotFound(f"conversation {scope['_id']!r} was not found")
        if found.get(MIGRATING) is None:
            return []
        served = await self.transcript(scope["_id"], user_id=scope.get("user_id"))
        end = pin.get("end")
        return [m for m in served if end is None or m.seq is None or m.seq < end]

    async def _lived_through(
        self,
        scope: dict[str, Any],
        pin: dict[str, Any],
        last: int,
        served: Mapping[int, str] | None = None,
    ) -> None:
        """After a stream's last batch (the last message served has `seq` `last`): Conflict
        unless the conversation it served is still under the id and in `scope`, no pop since
        the life was read removed a message it counts or served (`pops`; `end`, when `pin`
        names it, else past `last`), and, when a `seq` past `last` is reserved, no delete of
        it is under way (one lookup more, then)."""
        conversation_id = scope["_id"]
        life = same_as_read(conversation_id, pin)
        read = {"message_count": 1, "epoch": 1, "created_at": 1, **POPS_READ}
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(scope | life, read)
        if found is not None and "pops" in pin:
            end = int(pin.get("end", last + 1))
            kept = None if "end" in pin else served  # a `life`: what it counts, served or not
            _refuse_popped_since(conversation_id, found, int(pin["pops"]), end, kept)
        if found is not None and int(found.get("message_count") or 0) <= last + 1:
            return
        if found is not None and not await self._deletions.under_way(conversation_id, found):
            return
        raise Conflict(
            f"conversation {conversation_id!r} was deleted, started again or claimed by another "
            "account while its transcript was read: the messages served are not its whole "
            "transcript (read it again)"
        )

    async def stream_user_conversations(self, user_id: str) -> AsyncGenerator[Conversation, None]:
        """Every conversation document of a user, by id, one at a time (no transcripts), read
        `PAGE_FIRST_BATCH` at a time: a reply the server can send whatever their size."""
        user_id = validate_identifier(user_id, "user_id")
        cursor = (
            self._conversations.find({"user_id": user_id, **self._listed}, SUMMARY)
            .sort("_id", 1)
            .batch_size(PAGE_FIRST_BATCH)
        )
        try:
            with storage_errors("read the user's conversations"):
                async for doc in cursor:
                    yield Conversation.model_validate(doc)
        finally:
            await cursor.close()


SERVED_IDS_KEPT = 1_000
"""How many of the newest messages a streamed transcript served it remembers the ids of, to
tell a pop of one it served from a pop of one it had not reached (regenerated since, its
`seq` served again): a pop further back is taken as of a message served."""


def _remember_served(served: dict[int, str], docs: Sequence[Mapping[str, Any]]) -> None:
    """Add the ids of `docs`, about to be served, to `served`, the newest `SERVED_IDS_KEPT`."""
    served.update((int(d["seq"]), str(d["_id"])) for d in docs)
    for seq in sorted(served)[: max(0, len(served) - SERVED_IDS_KEPT)]:
        del served[seq]


def _refuse_popped_since(
    conversation_id: str,
    found: Mapping[str, Any],
    pops: int,
    end: int,
    served: Mapping[int, str] | None = None,
) -> None:
    """Conflict when a pop removed a message below `end` from the conversation `found` (read
    with `POPS_READ`) since a stream read it with `pops` pops finished: the messages served
    are not those it counted, or mix those popped with those logged after. With `served`
    (the ids a stream served, by `seq`), a popped message whose `seq` it served holding
    another message (the pop came before the stream reached it) is no such pop."""
    if served is not None:
        listed = [p for p in found.get("popped_messages") or () if isinstance(p, Mapping)]
        unserved = [
            {**p, "s": end} if served.get(int(p.get("s", -1)), p.get("i")) != p.get("i") else p
            for p in listed
        ]
        found = {**found, "popped_messages": unserved}
    if popped_since_read(found, pops, end - 1):
        raise Conflict(
            f"a message of conversation {conversation_id!r} was popped while its transcript "
            "was read: the messages served are not one transcript it had (read it again)"
        )


def _made_by(found: Sequence[Mapping[str, Any]], concerns: Sequence[CallKey]) -> bool:
    """Whether each call `concerns` names by its identity (a tool call id and the message
    that made it) is made by that message among `found`; one named by its id alone is."""
    made = {
        (call.get("id"), doc.get("_id"))
        for doc in found
        for call in doc.get("tool_calls") or ()
        if isinstance(call, Mapping)
    }
    return all(m is None or (c, m) in made for c, m in concerns)


def _listed_after(updated_at: datetime, last_id: str) -> dict[str, Any]:
    """The conversations a list shows after the one updated at `updated_at` with `last_id`."""
    return {
        "$or": [
            {"updated_at": {"$lt": updated_at}},
            {"updated_at": updated_at, "_id": {"$lt": last_id}},
        ]
    }


def _by_seq(
    order: SortOrder,
) -> tuple[list[tuple[str, int]], Callable[[dict[str, Any]], dict[str, Any]]]:
    """How a page of messages in `order` sorts, and the messages after a message read."""
    step = "$gt" if order == "asc" else "$lt"
    return [("seq", 1 if order == "asc" else -1)], lambda last: {"seq": {step: last["seq"]}}


async def _at_once(
    first: Callable[[], Awaitable[_First]], second: Callable[[], Awaitable[_Second]]
) -> tuple[_First, _Second]:
    """Both reads, the second sent while the first is (one wait, two commands): the second as
    a task, awaited after the first, or cancelled (and its outcome retrieved) when the first
    fails or the caller is cancelled. One the driver answers at once (the synchronous driver
    of `run_sync`, whose awaitables are neither coroutines nor futures) is simply awaited
    after the first. Each read is begun only where it is awaited or scheduled at once."""
    pending = second()
    if not (asyncio.iscoroutine(pending) or asyncio.isfuture(pending)):
        return await first(), await pending
    task = asyncio.ensure_future(pending)
    try:
        done = await first()
    except BaseException:
        task.cancel()
        task.add_done_callback(_retrieved)
        raise
    return done, await task


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Retrieve the outcome of a task no one awaits (cancelled, or failed first)."""
    if not task.cancelled():
        task.exception()


def _its_messages(
    conversation_id: str,
    found: Mapping[str, Any] | None,
    docs: list[dict[str, Any]],
    *,
    being_migrated: bool = False,
) -> list[dict[str, Any]] | None:
    """Of the messages read under a conversation's id, those the conversation document
    `found` with them (`_in_scope`) serves: none when it is no conversation (`STANDING`: a
    delete or an erasure that failed before its messages went, a fork not made yet):
    NotFound; None when no document is there (the caller tells a conversation not migrated
    yet from none at all), or one a migration run is still writing (`MIGRATING`: read from
    its legacy turns) unless `being_migrated` takes its messages stored so far; else those of
    its `epoch`, and those stored before epochs (a turn of a deleted conversation, reserved
    before the delete and inserted after it, may land under the id once the conversation was
    started again, until the delete's sweep)."""
    refuse_unless_fallback_serves(conversation_id, found)
    if found is None or (found.get(MIGRATING) is not None and not being_migrated):
        return None  # one the migration is still writing is read from its legacy turns
    return of_epoch(docs, found.get("epoch"))


def _kept_whole_but_cut(messages: Sequence[AgentMessage]) -> bool:
    """Whether a field of `messages`, served with its whole text, stays cut: its whole text
    (a file, `Truncation.blob_id`) was kept, and is gone since the message was read."""
    return any(
        isinstance(entry, Truncation) and entry.blob_id is not None
        for message in messages
        for entry in (message.truncated or {}).values()
    )


def _of_life(found: Mapping[str, Any]) -> dict[str, Any]:
    """`of_epoch` as a query: the messages of the life of the conversation document `found`,
    and those stored before epochs. What a window of the last messages (a page, the last
    `limit`) adds to its query when a late insert of another life lay in it, so the window
    holds as many of the life's as it asks for (the `(conversation_id, seq)` index serves
    it, the few messages of another life read and passed over)."""
    return {"epoch": _one_of_or_none(found.get("epoch"))}


async def _bounded_page(
    collection: Any,
    query: dict[str, Any],
    projection: dict[str, Any] | None,
    sort: list[tuple[str, int]],
    after: Callable[[dict[str, Any]], dict[str, Any]],
    limit: int,
) -> tuple[list[dict[str, Any]], bool]:
    """The first `limit` documents of `query` in `sort` order, fewer when they pass
    `PAGE_BYTES` (one at least), and whether more follow (`bounded_read`), each batch read
    from where the last ended (`after` the last document read)."""

    async def read(size: int, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
        scope = {"$and": [query, after(kept[-1])]} if kept else query
        found: list[dict[str, Any]] = (
            await collection.find(scope, projection).sort(sort).limit(size).to_list(None)
        )
        return found

    return await bounded_read(read, limit)


async def bounded_read(
    read: Callable[[int, list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]], limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """The first `limit` documents `read` gives, fewer when they pass `PAGE_BYTES` (one at
    least), and whether more follow.

    `read(size, kept)` reads the next `size` documents after those kept so far. The first
    batch is of `PAGE_FIRST_BATCH` at most, each next one as many as the room left holds by
    the largest document so far, so a page never reads much past what it serves and no
    reply holds more than about a page."""
    kept: list[dict[str, Any]] = []
    held, size = 0, min(limit + 1, PAGE_FIRST_BATCH)
    while True:
        docs = await read(size, kept)
        largest = 1
        for doc in docs:
            weight = _approximate_size(doc)
            if len(kept) == limit or (kept and held + weight > PAGE_BYTES):
                return kept, True
            kept.append(doc)
            held, largest = held + weight, max(largest, weight)
        if len(docs) < size:
            return kept, False
        size = max(1, min(limit + 1 - len(kept), (PAGE_BYTES - held) // largest + 1))


def _approximate_size(document: Any) -> int:
    """Roughly how many bytes a stored document takes: its text, that of its keys too, plus a
    little per value."""
    size, stack = 0, [document]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, dict):
            size += 16 * len(value) + sum(map(len, value))  # keys: text in BSON
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        else:
            size += 8
    return size


def _kept(message: AgentMessage, reach: Mapping[str, int]) -> bool:
    """Whether a message making or answering tool calls is on the stretch a page needs for one
    of their ids: from the page down to its `reach`, all the way for an id without one."""
    ids = [call.id for call in message.tool_calls or ()]
    if message.tool_call_id is not None:
        ids.append(message.tool_call_id)
    return any((message.seq or 0) >= reach.get(call_id, -1) for call_id in ids)


def _reached(messages: Sequence[AgentMessage], needed: Mapping[str, int]) -> dict[str, int]:
    """By id of `needed` with that many calls among `messages` (a stretch of a transcript
    up to a page, by `seq`) that no result among them answers (`calls_answered`), the `seq`
    of the earliest of the latest `needed[id]` of them: what a page's results take. An
    answer earlier than `messages` takes none of these (the later a call, the sooner it is
    taken), so the stretch from there on pairs them as the whole transcript does."""
    taken = {(messages[at].seq, call_id) for at, call_id in calls_answered(messages).values()}
    open_calls: dict[str, list[int]] = {}
    for message in reversed(messages):
        for call in message.tool_calls or ():
            if message.seq is not None and (message.seq, call.id) not in taken:
                open_calls.setdefault(call.id, []).append(message.seq)
    return {
        call_id: seqs[count - 1]
        for call_id, count in needed.items()
        if len(seqs := open_calls.get(call_id, [])) >= count
    }


def _seq_range(
    conversation_id: str, start: int, stop: int | None, user_id: str | None
) -> dict[str, Any]:
    """The query of a conversation's messages with `start <= seq < stop` (to the end without
    `stop`), of `user_id`'s when given: a range of the `{conversation_id, seq}` index."""
    seq: dict[str, int] = {"$gte": start}
    if stop is not None:
        seq["$lt"] = stop
    query: dict[str, Any] = {
        "conversation_id": validate_identifier(conversation_id, "conversation_id"),
        "seq": seq,
    }
    if user_id is not None:
        query["user_id"] = validate_identifier(user_id, "user_id")
    return query
