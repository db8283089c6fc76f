"""The legacy turns behind the store's seam: read fallback, dual write, and the deletes,
erasures and claims that must reach them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

import bson
from pymongo import UpdateMany
from pymongo.errors import DuplicateKeyError

from agent_store.core import (
    AgentMessage,
    Conflict,
    Conversation,
    InvalidInput,
    StorageFailure,
    to_utc_millis,
    utc_now,
)
from agent_store.legacy._convert import convert
from agent_store.legacy._documents import (
    CLAIM_RECORD,
    CLAIMED_FROM,
    CONVERSATION_COUNTERS,
    EPOCH,
    LEGACY_TURNS,
    MIGRATION_STATE,
    MIGRATION_STATE_ID,
    NAMING_FIELDS,
    RECORD_FIELD,
    SESSION_HITL,
    LegacyTurn,
    LiveConversation,
    Unnamed,
    as_claims_recorded,
    claim_record_id,
    claim_record_update,
    claim_records_owed,
    claimed_user,
    claimers,
    derived_user_id,
    id_filter,
    may_not_be_identifiers,
    named_filter,
    named_id,
    names_none,
    owner_of,
    owns_legacy,
    parse_turns,
    prompt_conversation,
    prompt_part_of,
    prompts_filter,
    reached_by,
    reference_in,
    scalar_filter,
    tell_apart,
    turn_times,
    user_named,
    user_values,
    users_part,
)
from agent_store.legacy._dual_write import (
    COPY_INTENDED,
    COPY_PIECES,
    COPY_RECORD,
    COPY_STATE,
    COPY_WRITTEN,
    copy_pieces,
    copy_record_id,
    cut_as_listed,
    legacy_turn_documents,
    legacy_turn_id,
)
from agent_store.legacy._session_hitl import (
    answer_record,
    owners_prompt,
    resolved_by_dual_write,
    with_session_prompts,
)
from agent_store.store import (
    CONVERSATION_DOCUMENT,
    CONVERSATIONS,
    DERIVED_CONVERSATION_PREFIX,
    DERIVED_TURN_PREFIX,
    DERIVED_USER_PREFIX,
    UNSTANDING_READ,
    Database,
    FallbackConversation,
    FullTextStore,
    LegacyHolder,
    LoggedTurn,
    TurnRules,
    bounded_read,
    conversation_by_id,
    fork_turn_id,
    not_utf8_at,
    ownership_read,
    read_as_stored,
    refuse_unless_fallback_serves,
    same_conversation,
    storage_errors,
)

_OWNERSHIP_FIELDS = {
    "conversation_id": 1,
    "user_id": 1,
    "created_at": 1,
    "dual_write": 1,
    CLAIMED_FROM: 1,
}
"""What tells a legacy conversation's owner (`owner_of`) and a user's part (`users_part`),
the claims that moved its turns (`claimers`), a live conversation's copies (`live_copy`)
apart."""
_PROMPT_OWNERSHIP_FIELDS = {"conversation_id": 1, "session_id": 1, "user_id": 1, "dual_write": 1}
"""What tells the `session_hitl` prompts a conversation takes (`owners_prompt`) and a user's
part (`prompt_part_of`) apart from the others."""

_STORED_ORDER = [("created_at", 1), ("_id", 1)]
"""The order an operator reads a conversation's raw legacy turns in (`LegacyTurns.turns`):
oldest first, by `created_at`, then `_id`."""

MAX_LEGACY_DOCUMENT_BYTES = 16 * 1024 * 1024 - 64 * 1024
"""A dual-written turn holds its whole texts while it fits in a BSON document (16 MiB, less
room for the server's own fields); past it they stay cut, and are cut further until each
document fits."""


class LegacyTurns:
    """Legacy turn documents (`agent_conversations_deprecated`) for the store.

    Pass it to `ConversationStore(db, legacy=…)` to serve conversations not
    migrated yet and to reach their turns when deleting, erasing or claiming;
    to `AgentMessageLogger(db, observers=[…])` with `dual_write=True` to keep
    every logged turn as a legacy turn too, during the rollback window.
    """

    def __init__(
        self,
        db: Database,
        *,
        rules: TurnRules | None = None,
        read_fallback: bool = True,
        dual_write: bool = False,
    ) -> None:
        """Work on `db`'s legacy collections; `rules` are the logger's (names, markers)."""
        self._turns = db[LEGACY_TURNS]
        self._prompts = db[SESSION_HITL]
        self._conversations = db[CONVERSATIONS]
        self._migration = db[MIGRATION_STATE]
        self._full_texts = FullTextStore(db)
        self._rules = rules or TurnRules()
        self.read_fallback = read_fallback
        self.dual_write = dual_write

    @property
    def copies_turns(self) -> bool:
        """With `dual_write`, every turn the logger stores owes a legacy copy
        (`CopyingObserver`): its messages are stored marked `copy_owed`, in the insert that
        stores them, so the gate tells a turn whose copy's every write failed from one logged
        with the dual write off."""
        return self.dual_write

    async def conversation(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> FallbackConversation | None:
        """The conversation converted from its legacy turns and prompts; None if it has none, or
        if `user_id` is given and the turns name another owner. For a user, only the user's part
        of it (`_users_part`, `prompt_part_of`): turns and prompts naming another user are left
        out, and so are the copies of a live conversation under the id that is not the user's,
        and the turns and prompts naming no user beside it, which are its owner's, dual write on
        or off (`reached_by`, `owns_legacy`: one lookup more, `_live`, only when the user has
        turns there). Only what is served is read whole: the turns told from their ownership
        fields first, for a user (`_users_part`), the prompts always (`_prompts_taken`), so text
        the driver cannot decode in another user's turn or prompt under the id is never read for
        her (another's conversation is as a missing one, hers is served without it); in her own
        part it is a StorageFailure, and to a service in any turn, as it reads them all. A turn
        or prompt whose owner or conversation cannot be read so (`ownership_read`) is nobody's:
        left out of every user's part; to a service, which reads every turn, such a turn is a
        Conflict naming it (`_refuse_unowned`, one lookup more).
        """
        query, unnamed = await self._turns_of(conversation_id)
        live, owns = None, True
        if user_id is None:
            await self._refuse_unowned(conversation_id, query)
        else:
            part = await self._users_part(conversation_id, query, unnamed, user_id)
            if part is None:
                return None
            query, live, owns = part
        with storage_errors("read the legacy turns"):
            whole = await self._recorded(await self._turns.find(query).to_list(None))
            turns = parse_turns(whole, unnamed.names)
        if user_id is not None:  # a turn changed since its ownership was read: judged again
            turns = [turns[i] for i in users_part(turns, user_id, live)]
        if not turns:
            return None
        conversion = convert(turns, rules=self._rules, undated_at=await self._undated_at(turns))
        if conversion.conversation is None:
            return None
        owner, claimed = conversion.owner, conversion.claimed

        def taken(prompt: Mapping[str, Any]) -> bool:
            # The owner's prompts (`owners_prompt`), as the migration takes them; for a user,
            # only her part's (`prompt_part_of`), as her delete takes them; each through the
            # claims the turns record (`claimed`).
            part = prompt_part_of(prompt, user_id, live, owns=owns, claimed=claimed)
            if user_id is not None and not part:
                return False
            return owners_prompt(owner, prompt, claimed)

        prompts = await self._prompts_taken(conversation_id, taken)
        conversion = with_session_prompts(conversion, prompts)
        assert conversion.conversation is not None
        return FallbackConversation(conversion.conversation, conversion.messages)

    async def _users_part(
        self, conversation_id: str, query: dict[str, Any], unnamed: Unnamed, user_id: str
    ) -> tuple[dict[str, Any], LiveConversation | None, bool] | None:
        """`user_id`'s part of the legacy turns `query` selects (those naming no conversation
        told apart by `unnamed`), told from their ownership fields only, as `holder` reads
        them: a query selecting her part's turns (`users_part`), the live conversation under
        the id (`_live`), and whether she owns the legacy conversation (`owns_legacy`). None
        when it is not hers (`owner_of` the turns she reaches, `reached_by`), or she has no
        turn in it. What a turn's texts hold is never decoded here, nor later for another
        user's turn, whoever reads."""
        with storage_errors("read the legacy turns"):
            read = await ownership_read(self._turns, query, _OWNERSHIP_FIELDS)
            found = parse_turns(await self._recorded(read.owned), unnamed.names)
        if not found:
            return None
        live = await self._live(conversation_id, found)
        if owner_of([found[i] for i in reached_by(found, user_id, live)]) != user_id:
            return None
        ids = [found[i].id for i in users_part(found, user_id, live)]
        if not ids:
            return None
        return {"$and": [query, {"_id": {"$in": ids}}]}, live, owns_legacy(found, user_id, live)

    async def _refuse_unowned(self, conversation_id: str, query: dict[str, Any]) -> None:
        """Conflict naming the legacy turns `query` selects whose owner or conversation
        cannot be read (`ownership_read`), for a service, which reads every turn of the id:
        whose conversation it is cannot be told, and no byte of it is read whole."""
        with storage_errors("read the legacy turns"):
            read = await ownership_read(self._turns, query, _OWNERSHIP_FIELDS)
        if read.unowned:
            raise Conflict(
                f"could not read the legacy conversation {conversation_id!r}: "
                + "; ".join(f"legacy turn {name}" for name in read.unowned)
                + ", so whose turn it is cannot be told: an operator corrects it in the "
                "database (MIGRATION.md)"
            )

    async def _prompts_taken(
        self, conversation_id: str, taken: Callable[[Mapping[str, Any]], bool]
    ) -> list[dict[str, Any]]:
        """The `session_hitl` prompts of the conversation (`prompts_filter`) that `taken`
        keeps, told from their ownership fields (`_PROMPT_OWNERSHIP_FIELDS`) before the
        whole of those kept is read (one lookup more, only when one is kept): what a prompt
        not taken holds, another user's included, is never decoded, text the driver cannot
        decode too. A prompt changed between the two reads is judged again."""
        named = prompts_filter(conversation_id)
        with storage_errors("read the pending prompt"):
            read = await ownership_read(self._prompts, named, _PROMPT_OWNERSHIP_FIELDS)
            ids = [prompt["_id"] for prompt in read.owned if taken(prompt)]
            if not ids:
                return []
            kept = {"$and": [named, {"_id": {"$in": ids}}]}
            whole: list[dict[str, Any]] = await self._prompts.find(kept).to_list(None)
        return [prompt for prompt in whole if taken(prompt)]

    async def _undated_at(self, turns: Sequence[LegacyTurn]) -> datetime:
        """The time served for turns none of which has a readable time (`turn_times`), the
        same on every read of the same data, so the conversation's times and version (its
        `ETag`) are too: the time the migration gives them, its first run's start, once a
        run recorded it (read here, never written: moving the conversation changes neither),
        else the Unix epoch, "unknown". Costs a lookup only for such turns."""
        if any(turn_times(turns)):
            return EPOCH  # not used: the turns' own times date them
        with storage_errors("read the migration's state"):
            state = await self._migration.find_one({"_id": MIGRATION_STATE_ID}, {"undated_at": 1})
        recorded = (state or {}).get("undated_at")
        return to_utc_millis(recorded) if isinstance(recorded, datetime) else EPOCH

    async def with_turns(self, conversation_ids: Sequence[str]) -> set[str]:
        """Which of `conversation_ids` have legacy turns, each found as every read finds a
        conversation's turns (`_turns_of`: its legacy id as text, an ObjectId or a number, the
        legacy id a derived `legacy-conversation-` id stands for, the `_id` a `legacy-turn-`
        id names). One indexed lookup per id, run at once (`_turns_of`'s for a derived id),
        and one scan of the turns naming no conversation for all the `legacy-turn-` ids
        among them; none for no ids. Each read as stored (`read_as_stored`): a turn whose
        `_id` holds bytes that are not valid UTF-8 is found too (was: a StorageFailure, and
        the viewer's lists and transcript a 500)."""
        ids = list(dict.fromkeys(conversation_ids))
        unnamed = await self._unnamed(*ids)  # one scan for all the `legacy-turn-` ids

        async def has_turns(conversation_id: str) -> bool:
            with storage_errors("read the legacy turns"):
                query, _ = await self._turns_of(conversation_id, unnamed)
                found = await read_as_stored(self._turns).find_one(query, {"_id": 1})
                return found is not None

        found = await asyncio.gather(*(has_turns(conversation_id) for conversation_id in ids))
        return {conversation_id for conversation_id, has in zip(ids, found, strict=True) if has}

    async def turns(self, conversation_id: str, *, limit: int) -> list[dict[str, Any]]:
        """The legacy turn documents the store knows as `conversation_id` (`_turns_of`, as the
        read fallback finds them), raw, oldest first (by `created_at`, then `_id`), the first
        `limit` of them: what an operator compares a migrated conversation with. Read as
        stored (`read_as_stored`): a text holding bytes that are not valid UTF-8 reads with
        each a lone surrogate, for the page to show escaped (`not_utf8_at`), never a
        StorageFailure for them all (was: the strict client refused the whole reply).

        NotFound, as the read fallback answers it, when the conversation document under the
        id is one the fallback never serves (`refuse_unless_fallback_serves`: a delete that
        failed part-way marked it and left these turns, or a fork not made yet), read after
        the turns: a delete that marks it later came after them. One lookup more."""
        with storage_errors("read the legacy turns"):
            query, _ = await self._turns_of(conversation_id)
            found = read_as_stored(self._turns).find(query).sort(_STORED_ORDER).limit(limit)
            turns = list(await found.to_list(None))
            conversation = await self._conversations.find_one(
                conversation_by_id(conversation_id), UNSTANDING_READ
            )
        refuse_unless_fallback_serves(conversation_id, conversation)
        return turns

    async def turns_page(
        self, conversation_id: str, *, skip: int = 0, limit: int
    ) -> tuple[list[dict[str, Any]], bool]:
        """The legacy turn documents of `turns`, from the `skip`-th on (0 the oldest), bounded
        by bytes as every page is: the first `limit`, fewer when they pass `PAGE_BYTES` (one
        at least, `bounded_read`), and whether more follow (read on from `skip` plus those
        given). Read in batches sized by the largest turn read so far, so no read holds much
        more than a page whatever a turn holds. NotFound as `turns` answers it."""
        if skip < 0 or limit < 1:
            raise InvalidInput(f"invalid page of legacy turns from {skip}, limit {limit}")
        with storage_errors("read the legacy turns"):
            query, _ = await self._turns_of(conversation_id)

            async def read(size: int, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
                found = read_as_stored(self._turns).find(query).sort(_STORED_ORDER)
                batch: list[dict[str, Any]] = (
                    await found.skip(skip + len(kept)).limit(size).to_list(None)
                )
                return batch

            turns, more = await bounded_read(read, limit)
            conversation = await self._conversations.find_one(
                conversation_by_id(conversation_id), UNSTANDING_READ
            )
        refuse_unless_fallback_serves(conversation_id, conversation)
        return turns, more

    async def holder(
        self, conversation_id: str, *, user_id: str | None = None
    ) -> LegacyHolder | None:
        """Whether the id exists as legacy turns to `user_id` (None: a service), and their
        owner; None if it does not. The copies of a live conversation under the id that is
        not the user's are none, and so are the turns naming no user or another user beside
        it (`reached_by`: one lookup more, `_live`, only when turns stand under the id).
        Turns whose owner cannot be read (`ownership_read`) hold the id too, for nobody: with
        no other turn to name an owner, the holder names none (was: set apart, they left the
        id free for anyone to create a conversation over them)."""
        query, _ = await self._turns_of(conversation_id)
        with storage_errors("read the legacy turns"):
            read = await ownership_read(self._turns, query, _OWNERSHIP_FIELDS)
            found = parse_turns(await self._recorded(read.owned))
        if found:
            found = [
                found[i]
                for i in reached_by(found, user_id, await self._live(conversation_id, found))
            ]
        if found:
            return LegacyHolder(owner_of(found))
        return LegacyHolder(None) if read.unowned else None

    async def delete(self, conversation_id: str, *, owner: str | None) -> int:
        """Delete `owner`'s part of the conversation's legacy turns and prompts; how many
        turns went, each once.

        The legacy conversation goes whole when its turns name `owner` as its owner (as the read
        fallback tells it); else only the turns and prompts naming `owner` go: another user's,
        under the same id, stay whoever deletes. The copies of a live conversation under the id,
        and the turns and prompts naming no user beside it, go with it only, for its owner
        (`users_part`, `owns_legacy`: one lookup more, `_live`, only when a legacy turn or
        prompt stands under the id), dual write on or off. A conversation migrated under a
        derived id reaches the turns and prompts of the id they named (one more lookup, only for
        such ids). The late legacy turns under the id no run has moved aside yet (`LATE_TURNS`)
        are read first, and those that are `owner`'s part of the conversation (`_late_parts`, as
        an erasure tells them, each read through the claims the conversation's turns record,
        `_users_of`; those naming no user only when `owner` owns it) go before the
        legacy collection's, read again then: a run moving them aside meanwhile inserts its
        copies before it deletes them from `agent_conversations`, and takes back the copies of
        those deleted there since it read them, so each is taken from wherever it stands. One
        taken from both (copied, not yet deleted by the run) counts once (`_counted_once`).
        """
        original = await self._original_id(conversation_id)
        turns, unnamed = await self._turns_of(conversation_id)
        names = [conversation_id, original or conversation_id]
        with storage_errors("delete the legacy turns"):
            standing = await self._late_turns(names)
            found = await self._owned(self._turns, turns)
            parsed = parse_turns(found, unnamed.names)
            prompts = _prompts_filter(conversation_id, original)
            read = await ownership_read(self._prompts, prompts, _PROMPT_OWNERSHIP_FIELDS)
            live = await self._live(conversation_id, [*parsed, *standing, *read.owned])
            owns = owns_legacy(parsed, owner, live)
            beside = dict.fromkeys(names, parsed)
            late = _parts_of(standing, owner, unnamed=owns, beside=beside)
            stranded = await self._conversations.delete_many(_late_of(late)) if late else None
            if late:  # a run may have moved some aside since the read: read them again
                found = await self._owned(self._turns, turns)
                parsed = parse_turns(found, unnamed.names)
            part = [found[i] for i in users_part(parsed, owner, live)]
            ids = [d["_id"] for d in part]
            among = {"$and": [turns, *_among_ids(ids)]}
            deleted = await self._turns.delete_many(among) if ids else None
            await self._forget_claims([*part, *(d for d in standing if d["_id"] in late)])
            claimed = claimers([*parsed, *parse_turns(standing)])
            theirs = [
                d["_id"]
                for d in read.owned
                if prompt_part_of(d, owner, live, owns=owns, claimed=claimed)
            ]
            if theirs:
                await self._prompts.delete_many({"$and": [prompts, *_among_ids(theirs)]})
        return _counted_once(deleted, stranded, late, ids)

    async def _turns_of(
        self, conversation_id: str, unnamed: Unnamed | None = None
    ) -> tuple[dict[str, Any], Unnamed]:
        """The filter of the legacy turns the store knows as `conversation_id`, and the turns
        naming no conversation told apart (`tell_apart`; `unnamed` when read already): the
        one rule the read fallback, the ownership check and the delete share
        (`turns_known_as`). A turn naming none whose `_id` holds bytes that are not valid
        UTF-8 (`not_utf8_at`) is in no filter: no query can send it."""
        original = await self._original_id(conversation_id)
        if unnamed is None:
            unnamed = await self._unnamed(conversation_id)
        ids = [i for i in unnamed.ids.get(conversation_id, []) if not_utf8_at(i) is None]
        return turns_known_as(conversation_id, original, ids), unnamed

    async def _live(self, conversation_id: str, read: Sequence[object]) -> LiveConversation | None:
        """The conversation document stored under the id whose legacy documents were `read`
        (its legacy turns, and where read, its late ones and prompts), in any state:
        one lookup, only when one stands; else None. Looked up whether or not its dual write
        copied anything there, so whose the documents naming no user beside it are
        (`owns_legacy`), and whose a user's own late turn there is (`reached_by`), never
        depend on dual write (was: only with a copy there, so with dual write off the last
        user a late legacy turn named took the turns and prompts naming none)."""
        if not read:
            return None
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"user_id": 1}
            )
        return None if found is None else LiveConversation(found.get("user_id"))

    async def _unnamed(self, *conversation_ids: str) -> Unnamed:
        """When a `legacy-turn-` id is among `conversation_ids`, the turns naming no
        conversation, told apart (`tell_apart`: one scan of their `_id`s and times, only
        then); else none. Read as stored (`read_as_stored`), as the migration reads them, so
        each is named as it names them, and one whose `_id` or time holds bytes that are not
        valid UTF-8 stops no `legacy-turn-` id's read (was: a StorageFailure for them all)."""
        if not any(cid.startswith(DERIVED_TURN_PREFIX) for cid in conversation_ids):
            return Unnamed({}, {})
        with storage_errors("read the legacy turns"):
            query = names_none("conversation_id")
            found = await read_as_stored(self._turns).find(query, NAMING_FIELDS).to_list(None)
            return tell_apart(found)

    async def _original_id(self, conversation_id: str) -> str | None:
        """The legacy id a conversation migrated under a derived `legacy-conversation-` id
        names, as its document records it (one lookup, only for such ids); else None."""
        if not conversation_id.startswith(DERIVED_CONVERSATION_PREFIX):
            return None
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id), {"legacy_conversation_id": 1}
            )
        return legacy_id_of(conversation_id, (found or {}).get("legacy_conversation_id"))

    async def erase_user(self, user_id: str) -> int:
        """Delete the user's part (`users_part`) of the legacy conversations the user owns,
        with their prompts, and every turn and prompt naming the user elsewhere, by any value
        read as the user (`_naming`); and the late legacy turns (`LATE_TURNS`) naming the
        user, and the user's part of those of the conversations the user owns (`_late_parts`,
        as the user's delete of each takes them), first, as a delete does; how many turns
        went, each once (`_counted_once`). The user owns the legacy conversations under the
        ids of her conversations stored here (`_stored_lives`), whatever their legacy turns
        name, so the turns and prompts naming no user beside them go too, dual write on or
        off, as her delete of each takes them. The legacy collection is read again once the
        late turns went (a run moving them aside meanwhile: see `delete`), whether or not any
        stood, as a run may have moved them all between the two reads (an erasure is rare:
        two reads of it). Every turn is judged as its conversation's turns read it
        (`_users_of`): one naming a user id a claim moved its conversation away from is the
        claimer's, which the erasure of that id leaves. The user's claim records
        (`_claim_records`, one lookup) reach her moved turns the old service saved again
        naming an older id, and go with them (one command more, only when she has some)."""
        with storage_errors("erase the user's legacy turns"):
            stored = await self._stored_lives(user_id)
            recorded = await self._claim_records(user_id)
            read = await self._users_turns(user_id, stored, recorded)
            owned, _, parsed = await self._users_parts(user_id, read)
            read_already = {**{name: [] for name in stored}, **parsed}
            late = await self._late_naming(user_id, read_already, recorded)
            late += await self._late_parts(user_id, sorted(owned), beside=parsed)
            stranded = await self._conversations.delete_many(_late_of(late)) if late else None
            read = await self._users_turns(user_id, stored, recorded)
            owned_now, part, parsed = await self._users_parts(user_id, read)
            users = _users_of(read.naming, parsed)
            naming = [d for d, user in zip(read.naming, users, strict=True) if user == user_id]
            turns = [d["_id"] for d in naming] + part
            deleted = await self._turns.delete_many({"_id": {"$in": turns}}) if turns else None
            prompts = await self._users_prompts(user_id, {**owned, **owned_now}, parsed)
            if prompts:
                await self._prompts.delete_many({"_id": {"$in": prompts}})
            if recorded:  # the user's claim records name her: they go with her turns
                await self._migration.delete_many({"_id": {"$in": [r["_id"] for r in recorded]}})
        return _counted_once(deleted, stranded, late, turns)

    async def _late_naming(
        self,
        user_id: str,
        beside: Mapping[str, list[LegacyTurn]],
        recorded: Sequence[Mapping[str, Any]],
    ) -> list[Any]:
        """The `_id`s of the late legacy turns (`LATE_TURNS`) that are the user's as their
        conversation's turns read them (`_users_of`): those naming her, but one naming a user
        id a claim moved its conversation away from, which is the claimer's; and those of the
        same conversations naming a user id she claimed. Every turn of those conversations
        is read for their claims (`_turns_under`: the late ones, which may hold them all, no
        run having moved any aside yet, and those of the legacy collection not read already,
        `beside`): a lookup or two more, only when late turns naming her stand."""
        found = await self._naming(
            self._conversations, user_id, _OWNERSHIP_FIELDS, within=LATE_TURNS, recorded=recorded
        )
        beside, late = await self._turns_under(map(_named_apart, found), beside)
        late += [d for d in found if _named_apart(d) is None]
        return _theirs(late, user_id, beside)

    async def _naming(
        self,
        collection: Any,
        user_id: str,
        fields: dict[str, Any],
        *,
        within: dict[str, Any] | None = None,
        recorded: Sequence[Mapping[str, Any]] = (),
    ) -> list[dict[str, Any]]:
        """The documents (`fields` of them) of `collection` naming `user_id` by any value read
        as it (`user_named`: `42` is user "42", as the read fallback reads it), so an erasure or
        a claim reaches what the user's token reads. Found by those values (`user_values`); for
        a user the migration derives (`derived_user_id`), named by a value that is no
        identifier, by those values too (`may_not_be_identifiers`: a scan, for such a user
        only). With `within`, only those it selects too. Each turn is read as its claim record
        says (`_recorded`); with `recorded`, the claim records naming the user (`_claim_records`),
        the turns they are of too, whatever user id they hold (the old service re-saved them)."""
        query = _naming_query(user_id)
        if recorded:
            query = {"$or": [query, *_of_records(recorded)]}
        if within is not None:
            query = {"$and": [query, within]}
        found = (await ownership_read(collection, query, {**fields, "user_id": 1})).owned
        found = as_claims_recorded(await self._recorded(found), recorded)
        return [d for d in found if user_named(d.get("user_id")) == user_id]

    async def _owned(self, collection: Any, query: dict[str, Any]) -> list[dict[str, Any]]:
        """The legacy turns of `collection` `query` selects, their ownership fields
        (`_OWNERSHIP_FIELDS`) read as stored (`ownership_read`: those whose fields cannot be
        read set apart) and as their claim records say (`_recorded`)."""
        return await self._recorded(
            (await ownership_read(collection, query, _OWNERSHIP_FIELDS)).owned
        )

    async def _recorded(self, documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The legacy turn documents of one read as their claim records say
        (`as_claims_recorded`): a moved turn the old service saved again from its cache is
        read as the claim moved it. One lookup, only when one of them carries a claim
        (`claim_records_owed`): a read of turns no claim moved costs nothing more."""
        owed = claim_records_owed(documents)
        if not owed:
            return documents
        records = await self._migration.find({"_id": {"$in": owed}}).to_list(None)
        return as_claims_recorded(documents, records)

    async def _forget_claims(self, deleted: Iterable[Mapping[str, Any]]) -> None:
        """Delete the claim records (`CLAIM_RECORD`) of these legacy turns, deleted: a record
        left behind would tell a turn saved under the same `_id` since (a conversation started
        again under the id: its dual-written copy) as the claimer's. Whether or not a turn
        carries a claim: one the old service saved again in place carries none, yet has its
        record. One command, none for no turn."""
        if records := sorted({claim_record_id(d["_id"]) for d in deleted}):
            await self._migration.delete_many({"_id": {"$in": records}})

    async def _claim_records(self, user_id: str) -> list[dict[str, Any]]:
        """The claim records (`CLAIM_RECORD`) naming `user_id` as the user the last claim of
        their turn wrote: what a claim or an erasure of the user reaches beside the turns
        naming the user, those the old service saved again naming an older id. One lookup."""
        query = {"kind": CLAIM_RECORD, "user_id": user_id}
        found: list[dict[str, Any]] = await self._migration.find(query).to_list(None)
        return found

    async def _record_claims(
        self, moved: Sequence[Mapping[str, Any]], from_user_id: str, to_user_id: str
    ) -> None:
        """Record that the claim of `from_user_id` moves these legacy turns to `to_user_id`
        (`CLAIM_RECORD`, one record per turn, by `claim_record_id`), before they are moved:
        a claim stopped between the two leaves each turn the old id's, or the claimer's once
        a turn of its conversation moved (`as_claims_recorded`), never another's; run again,
        it moves those still read as the old id's, writing the same records. One round trip,
        none for no turn."""
        if not moved:
            return
        at = utc_now()
        # `UpdateMany` on one `_id` is `UpdateOne`, which mongomock's bulk cannot take
        writes = [
            UpdateMany(
                {"_id": claim_record_id(d["_id"])},
                {
                    **claim_record_update(to_user_id, [*_claimed_from(d), from_user_id], at),
                    "$setOnInsert": {"turn_id": d["_id"]},
                },
                upsert=True,
            )
            for d in moved
        ]
        await self._migration.bulk_write(writes, ordered=False)

    async def _turns_under(
        self, names: Iterable[str | None], read: Mapping[str, list[LegacyTurn]]
    ) -> tuple[dict[str, list[LegacyTurn]], list[dict[str, Any]]]:
        """The turns of the conversations `names` (None: naming none, left out), by name,
        whose claims (`claimers`) tell whose each of their turns and prompts is
        (`_users_of`): the late ones (`LATE_TURNS`), which a claim of a conversation no run
        moved aside yet records its claims on, and those of the legacy collection, those
        `read` already taken as read; with the late ones as read, to take. The one read of
        a conversation's claims the claim and the erasure share. Two lookups at most, one
        when every conversation's legacy turns were read, none for no names."""
        wanted = sorted({name for name in names if name is not None})
        if not wanted:
            return {}, []
        late = await self._late_turns(wanted)
        unread = [name for name in wanted if name not in read]
        found: list[dict[str, Any]] = []
        if unread:
            query = {"$or": [named_filter("conversation_id", name) for name in unread]}
            found = await self._owned(self._turns, query)
        beside = {name: list(read.get(name, [])) for name in wanted}
        for name, turns in _parsed_by_name([*found, *late]).items():
            beside.setdefault(name, []).extend(turns)
        return beside, late

    async def _users_prompts(
        self,
        user_id: str,
        owned: dict[str, LiveConversation | None],
        read: Mapping[str, list[LegacyTurn]],
    ) -> list[Any]:
        """The `_id`s of the `session_hitl` prompts an erasure of `user_id` takes: those
        naming the user (`_naming`), and those naming no user in a conversation the user
        owns (`owned`, each as `prompt_conversation` names it, with its live conversation),
        told by `prompt_part_of` over every prompt of those conversations, as the delete
        tells them, through the claims of the conversation's turns (`_turns_under`, those
        `read` already taken as read): a prompt naming a user id a claim moved its
        conversation away from is the claimer's, which the erasure of that id leaves. One
        read, and the conversations' turns (a lookup or two) only when a prompt is found."""
        query = {"$or": [_naming_query(user_id), *(prompts_filter(name) for name in owned)]}
        found = (await ownership_read(self._prompts, query, _PROMPT_OWNERSHIP_FIELDS)).owned
        beside, _ = await self._turns_under(map(prompt_conversation, found), read)
        taken = []
        for d in found:
            name = prompt_conversation(d)
            live = owned.get(name) if name is not None else None
            claimed = claimers(beside.get(name, [])) if name is not None else {}
            if prompt_part_of(d, user_id, live, owns=name in owned, claimed=claimed):
                taken.append(d["_id"])
        return taken

    async def _users_turns(
        self,
        user_id: str,
        stored: dict[str, LiveConversation],
        recorded: Sequence[Mapping[str, Any]],
    ) -> UsersTurns:
        """The legacy turns naming the user (`_naming`: those her claim records are of too,
        `recorded`, as they say), and those under the ids of her conversations stored here
        (`stored`), with the fields telling their owner: one read for all, so an erasure
        reaching what names no user beside her conversations costs no round trip more."""
        beside = [named_filter("conversation_id", name) for name in sorted(stored)]
        query = {"$or": [_naming_query(user_id), *_of_records(recorded), *beside]}
        found = await self._owned(self._turns, query)
        found = as_claims_recorded(found, recorded)
        naming = [d for d in found if user_named(d.get("user_id")) == user_id]
        under = [d for d in found if named_id(d.get("conversation_id")) in stored]
        return UsersTurns(naming, under, stored)

    async def _stored_lives(self, user_id: str) -> dict[str, LiveConversation]:
        """The user's conversations stored here (in any state), each the live conversation of
        the legacy documents under its id, and under the legacy id a derived id records: the
        user owns what names no user there (`owns_legacy`). One round trip."""
        stored = await self._conversations.find(
            {"user_id": user_id, **CONVERSATION_DOCUMENT}, {"legacy_conversation_id": 1}
        ).to_list(None)
        names = {d["_id"] for d in stored}
        names |= {legacy_id_of(d["_id"], d.get("legacy_conversation_id")) for d in stored} - {None}
        return {str(name): LiveConversation(user_id) for name in names if name is not None}

    async def _late_parts(
        self,
        owner: str | None,
        conversation_ids: Sequence[str],
        *,
        beside: Mapping[str, list[LegacyTurn]],
    ) -> list[Any]:
        """The `_id`s of the late legacy turns (`LATE_TURNS`) under `conversation_ids` that
        are `owner`'s part of them (`_parts_of`, each conversation's turns in the legacy
        collection `beside` them, read already): the one rule the delete and the erasure
        share. One round trip, none without ids."""
        late = await self._late_turns(conversation_ids)
        return _parts_of(late, owner, unnamed=True, beside=beside)

    async def _late_turns(self, conversation_ids: Sequence[str]) -> list[dict[str, Any]]:
        """The late legacy turns (`LATE_TURNS`) under `conversation_ids` (each by every
        spelling of it, `named_filter`), with the fields telling whose each is
        (`_OWNERSHIP_FIELDS`: the user it names, a claim's `claimed_from`). One round trip,
        none without ids."""
        if not conversation_ids:
            return []
        named = sorted(set(conversation_ids))
        held = {"$or": [named_filter("conversation_id", cid) for cid in named]}
        late = {"$and": [held, LATE_TURNS]}
        return await self._owned(self._conversations, late)

    async def _users_parts(
        self, user_id: str, read: UsersTurns
    ) -> tuple[dict[str, LiveConversation | None], list[Any], dict[str, list[LegacyTurn]]]:
        """The conversations the user owns, each as the reader names it (`named_id`: `42` and
        `"42"`, `ObjectId(X)` and `"X"` are one), with the live conversation stored under its
        id, if any (`LiveConversation`), and the `_id`s of the user's part of them all
        (`users_part`): those the turns naming the user are filed in that she owns, and those
        under the ids of her conversations stored here, all hers (`read`, `_users_turns`). The
        owner is told over every turn of the conversation, whichever of its ids each names
        (`named_filter`), as the read fallback, a delete and the migration tell it: an erasure
        takes another owner's part of no conversation, and the whole part of those the user
        owns; a live conversation's copies, and what names no user beside it, go with the
        erasure of its owner only. Turns naming her under other ids cost two lookups more:
        their conversations' turns, and their live conversations (`_lives`). With them, the
        turns of each conversation read, by name (whose claims `_users_of` reads)."""
        stored = read.stored
        values = [v for v in _conversations_named(read.naming) if named_id(v) not in stored]
        found = list(read.under)
        if values:
            query = {"$or": [named_filter("conversation_id", value) for value in values]}
            found += await self._owned(self._turns, query)
        by_name: dict[str, list[dict[str, Any]]] = {}
        for doc in found:
            if (name := named_id(doc.get("conversation_id"))) is not None:
                by_name.setdefault(name, []).append(doc)
        parsed = {name: parse_turns(docs) for name, docs in by_name.items()}
        others = {name: turns for name, turns in parsed.items() if name not in stored}
        lives: dict[str, LiveConversation] = {**await self._lives(others), **stored}
        owned: dict[str, LiveConversation | None] = dict(stored)
        part: list[Any] = []
        for name, turns in parsed.items():
            if owns_legacy(turns, user_id, lives.get(name)):
                owned[name] = lives.get(name)
            part += [by_name[name][i]["_id"] for i in users_part(turns, user_id, lives.get(name))]
        return owned, part, parsed

    async def _lives(
        self, conversations: dict[str, list[LegacyTurn]]
    ) -> dict[str, LiveConversation]:
        """Of the legacy conversations by name, those whose live conversation is stored under
        the id they are stored under (`_live`, dual write on or off: in one lookup for them
        all; none for no conversation)."""
        under = {turns[0].stored_conversation_id: name for name, turns in conversations.items()}
        if not under:
            return {}
        query = {"_id": {"$in": list(under)}, **CONVERSATION_DOCUMENT}
        found = await self._conversations.find(query, {"user_id": 1}).to_list(None)
        return {under[d["_id"]]: LiveConversation(d.get("user_id")) for d in found}

    async def claim(self, from_user_id: str, to_user_id: str, *, kept: Sequence[str] = ()) -> int:
        """Move the user's legacy turns, and the prompts naming the user, to another user id,
        but those of the conversations `kept` (the claim left them to the user: a delete
        marked them), which stay with them; how many turns moved. Each turn moved records
        the user id it moved away from (`CLAIMED_FROM`), in the same command: a turn the old
        service, which knows of no claim, logs or re-saves since naming that id in its
        conversation is the claimer's (`claimers`), to the read fallback and the migration,
        and so is a prompt it raises so. Each turn and prompt naming the user is read as its
        conversation's turns read it (`_users_of`, over every turn of it, `_turns_under`), as
        the delete and the erasure read it: one naming a user id an earlier claim moved its
        conversation away from is that claimer's, which a second claim of the id leaves (was:
        moved, so the second claimer was served the first one's conversation, and the next
        `run` stored it hers). Each turn moved is recorded first where the old service never
        writes (`_record_claims`), so its re-save from the old service's cache loses no claim;
        the turns the user's records are of are reached too (`_claim_records`), whatever user
        id a re-save left them naming. A lookup or two more, only when the user is named."""
        left = [await self._kept_filters(conversation_id) for conversation_id in kept]
        with storage_errors("claim the legacy turns"):
            recorded = await self._claim_records(from_user_id)
            turns = await self._naming(
                self._turns, from_user_id, _OWNERSHIP_FIELDS, recorded=recorded
            )
            late = await self._naming(
                self._conversations,
                from_user_id,
                _OWNERSHIP_FIELDS,
                within=LATE_TURNS,
                recorded=recorded,
            )
            prompts = await self._naming(self._prompts, from_user_id, _PROMPT_OWNERSHIP_FIELDS)
            names = [*map(_named_apart, [*turns, *late]), *map(prompt_conversation, prompts)]
            beside, _ = await self._turns_under(names, {})
            moved = 0
            places = ((self._turns, turns, None), (self._conversations, late, LATE_TURNS))
            for collection, found, within in (*places, (self._prompts, prompts, None)):
                index = int(collection is self._prompts)
                ids = _theirs(found, from_user_id, beside, prompts=bool(index))
                if ids:
                    query: dict[str, Any] = _late_of(ids) if within else {"_id": {"$in": ids}}
                    if left:
                        query["$nor"] = [filters[index] for filters in left]
                    update: dict[str, Any] = {"$set": {"user_id": to_user_id}}
                    if collection is not self._prompts:
                        update["$addToSet"] = {CLAIMED_FROM: from_user_id}
                        taken = await self._taken(collection, query, found, ids, kept=bool(left))
                        await self._record_claims(taken, from_user_id, to_user_id)
                    done = await collection.update_many(query, update)
                    moved += int(done.modified_count) if collection is not self._prompts else 0
        return moved

    async def _taken(
        self,
        collection: Any,
        query: dict[str, Any],
        found: list[dict[str, Any]],
        ids: list[Any],
        *,
        kept: bool,
    ) -> list[dict[str, Any]]:
        """The turns of `found` (`ids` of them) the claim's `query` moves: all, unless some
        conversations are `kept`, whose turns the query leaves (one lookup more then)."""
        chosen = set(map(claim_record_id, ids))
        if kept:
            left = await collection.find(query, {"_id": 1}).to_list(None)
            chosen = {claim_record_id(d["_id"]) for d in left}
        return [d for d in found if claim_record_id(d["_id"]) in chosen]

    async def _kept_filters(self, conversation_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The filters of the legacy turns, and of the prompts, of the conversation the store
        knows as `conversation_id`, as its delete takes them."""
        turns, _ = await self._turns_of(conversation_id)
        return turns, _prompts_filter(conversation_id, await self._original_id(conversation_id))

    async def prompt_resolved(self, conversation_id: str, request_id: str) -> None:
        """With `dual_write`, mark the conversation's `session_hitl` prompt `request_id`
        resolved (`resolved_by_dual_write`), where the old service records it: after a
        rollback it asks it no more, and a second attempt keeps it resolved. Only the
        prompts of its owner's part (`owners_prompt`, as a delete and the migration take
        them): another user's prompt of the same request id is never marked by the owner's
        answer, and stays pending, kept in its problem, and so does one whose owner cannot be
        read (`ownership_read`: nobody's). Three round trips: the conversation's owner (and
        the legacy id a derived id names), its prompts of the id, the mark; two more when a
        prompt names another user id than the owner (the conversation's claims, which make
        one naming the id a claim moved it from the claimer's: `_owners_prompts`). A prompt the
        owner's part of `session_hitl` does not hold (raised by a live turn: the dual write
        writes turns) gets a record of the answer instead (`answer_record`,
        one per request id, in the mark's round trip), which a second attempt after a rollback
        reads: the document that remembered the answer went with the rollback."""
        if not self.dual_write:
            return
        with storage_errors("read the conversation"):
            found = await self._conversations.find_one(
                conversation_by_id(conversation_id),
                {"user_id": 1, "legacy_conversation_id": 1, "legacy_user_id": 1},
            )
        found = found or {}
        original = None
        if conversation_id.startswith(DERIVED_CONVERSATION_PREFIX):
            original = legacy_id_of(conversation_id, found.get("legacy_conversation_id"))
        owner = found.get("user_id")
        query = {
            "$and": [
                _prompts_filter(conversation_id, original),
                id_filter("request_id", request_id, by_value=False),
            ]
        }
        with storage_errors("write the resolved prompt (dual write)"):
            projection = {"user_id": 1, "conversation_id": 1, "session_id": 1}
            prompts = (await ownership_read(self._prompts, query, projection)).owned
            ids = await self._owners_prompts(owner, prompts)
            if ids:
                mark = {"$set": resolved_by_dual_write(utc_now())}
                await self._prompts.update_many({"_id": {"$in": ids}}, mark)
                return
            named = original if original is not None else conversation_id
            user = copied_user(owner, found.get("legacy_user_id"))
            record = answer_record(named, user, request_id, utc_now())
            record_id = legacy_turn_id(named, f"answer\0{request_id}")
            await self._prompts.replace_one({"_id": record_id}, record, upsert=True)

    async def _owners_prompts(self, owner: str | None, prompts: list[dict[str, Any]]) -> list[Any]:
        """The `_id`s of the `prompts` (of one conversation and request id) that are the
        owner's (`owners_prompt`), read through the claims its turns record (`claimers`), as
        the read fallback and `run` read them: one the old service raised after a claim
        naming the pre-claim user id is the claimer's. The claims are read (two lookups,
        `_turns_under`) only when some prompt is not the owner's as stored."""
        ids = [d["_id"] for d in prompts if owners_prompt(owner, d)]
        if len(ids) == len(prompts):
            return ids
        beside, _ = await self._turns_under(map(prompt_conversation, prompts), {})
        users = _users_of(prompts, beside, prompts=True)
        return [d["_id"] for d, user in zip(prompts, users, strict=True) if user in (None, owner)]

    async def turn_logged(self, turn: LoggedTurn, conversation: Conversation) -> None:
        """With `dual_write`, upsert the turn as legacy turns; a retry completes the same ones.

        They name the conversation as its legacy turns do, so the old reader finds them in
        it after a rollback: a conversation migrated under a derived `legacy-conversation-`
        id by the legacy id it stands for (its document's `legacy_conversation_id`, which
        the logger hands over: no more reads), and its owner, when the migration derived
        it, by the legacy user id it derived it from (`copied_user_id`: no more reads). A
        fork's copies are the legacy turns of its original they came from, one each
        (`ForkOrigin.turn_starts`); a retry writes a copy as its record lists it
        (`_intend_copy`). The legacy reader knows no GridFS: a message cut to its
        bound is written whole (two more lookups, for such a turn only). Then the
        conversation is looked up (one more round trip): when it was deleted meanwhile, the
        turns just written go again, so a delete finishing before the dual write lands does
        not bring it back. The copy is recorded in the migration's collection as intended
        before it is written (`_intend_copy`, one more round trip), each of its documents
        naming that record (`RECORD_FIELD`), and the record confirmed once it is
        (`_record_copy`, one more): a record lost never leaves a copy the gate cannot check,
        nor a copy never written one it calls deleted. Its messages were stored marked
        `copy_owed` (`copies_turns`), so a turn whose intended record failed, never sent
        again, is still one the gate expects a copy of. Every document
        fits in `MAX_LEGACY_DOCUMENT_BYTES` (texts cut further when the cut ones do not:
        `legacy_turn_documents`), so the copy is written; a copy still refused is a
        StorageFailure, never InvalidInput: the turn is stored by now.

        A replay never writes back a copy its record confirmed (`COPY_WRITTEN`): a legacy
        turn of it gone was deleted by someone (on the old service after a rollback, say),
        and the gate's question about it (`COPY_GONE`) stands; its record stays as it is.
        A replay of a copy still `COPY_INTENDED` completes it (`_write_copy`): each legacy
        turn of it missing is written, none standing written over. No read more: the record
        is read back by a retry already (`_intend_copy`).
        """
        if not self.dual_write:
            return
        record_id = copy_record_id(turn.conversation_id, turn.turn_id, conversation.epoch)
        try:
            with storage_errors("write the legacy turn (dual write)"):
                pieces = turn_copy_pieces(conversation, turn.turn_id, turn.messages)
                intended = await self._intend_copy(record_id, pieces, turn.messages)
            if intended.confirmed:
                return  # a replay: what of the copy is gone was deleted, the gate asks
            documents = await self._copy_documents(conversation, turn, intended.listed)
            with storage_errors("write the legacy turn (dual write)"):
                for document in documents:
                    document[RECORD_FIELD] = record_id
                written = await self._write_copy(documents, completing=intended.replayed)
                await self._record_copy(record_id, intended.listed)
                await self._unless_deleted(conversation, written)
        except InvalidInput as exc:
            # The turn is stored by now: a copy refused is no fault of the caller's input.
            raise StorageFailure(f"{exc.message}; the turn itself is stored") from exc

    async def _copy_documents(
        self, conversation: Conversation, turn: LoggedTurn, listed: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """The legacy turns of a turn's copy, cut as its record lists them (`listed`), each
        fitting `MAX_LEGACY_DOCUMENT_BYTES`; texts the store cut written whole (two lookups,
        for such a turn only) unless they would then not fit."""
        documents = turn_copy(
            conversation, turn.turn_id, turn.messages, MAX_LEGACY_DOCUMENT_BYTES, listed=listed
        )
        if any(m.truncated for m in turn.messages):
            restored = await self._full_texts.restore(turn.messages)
            whole = turn_copy(conversation, turn.turn_id, restored, listed=listed)
            if all(len(bson.encode(d)) <= MAX_LEGACY_DOCUMENT_BYTES for d in whole):
                documents = whole  # else the texts stay cut: the turn is never lost over it
        return documents

    async def _write_copy(
        self, documents: Sequence[dict[str, Any]], *, completing: bool
    ) -> list[dict[str, Any]]:
        """Write the legacy turns of a turn's copy; those written. A first copy replaces any
        standing under their `_id`s; a copy `completing` one its record still holds intended
        (a replay) inserts each one missing alone and leaves one standing as it is (the
        old service may have edited it after a rollback): same commands, no read."""
        written: list[dict[str, Any]] = []
        for document in documents:
            if not completing:
                await self._turns.replace_one({"_id": document["_id"]}, document, upsert=True)
            else:
                try:
                    await self._turns.insert_one(document)
                except DuplicateKeyError:
                    continue  # standing: never written over
            written.append(document)
        return written

    async def _intend_copy(
        self, record_id: str, pieces: list[dict[str, Any]], messages: Sequence[AgentMessage]
    ) -> _Intended:
        """Record, before the copy is written, that the turn is to be copied (`COPY_RECORD`,
        `COPY_INTENDED`, by `copy_record_id`: no name, no content), as which legacy turns
        (`COPY_PIECES`, `copy_pieces`: each `_id` and the `seq`s it holds), where the legacy
        service never writes and a rollback moves nothing: the gate expects a copy of a live
        turn so recorded only, each of those legacy turns
        (`migrations.dual_writes.deleted`); one never copied (the dual write off) has no
        copy to lose. The legacy turns the copy is written as: those its record lists. A
        retry (a replay) keeps a record already written, confirmed or not, and the legacy
        turns it lists, read back (one lookup more, for a retry only): a copy is cut as it
        was first, never as the conversation's document says now (a fork's, written again
        by a second attempt after a rollback, says no more where the turns of its original
        began; was: the replay cut it at user messages alone, writing an exchange twice and
        setting the record's list to lose one). A record whose list does not cut the turn's
        `messages` (`cut_as_listed`: an earlier release's, listing none or no `seq`s) gets
        these `pieces`. What the record said of the copy (`_Intended`): a retry's record read
        back confirmed (`COPY_WRITTEN`, or holding no state: an earlier release's) is left as
        it is, its copy never written again (`turn_logged`)."""
        intended = {"kind": COPY_RECORD, COPY_STATE: COPY_INTENDED, "at": utc_now()}
        update = {"$setOnInsert": intended | {COPY_PIECES: pieces}}
        written = await self._migration.update_one({"_id": record_id}, update, upsert=True)
        if written.upserted_id is not None:
            return _Intended(pieces, replayed=False, confirmed=False)
        projection = {COPY_PIECES: 1, COPY_STATE: 1}
        record = await self._migration.find_one({"_id": record_id}, projection) or {}
        listed = record.get(COPY_PIECES)
        if record.get(COPY_STATE, COPY_WRITTEN) != COPY_INTENDED:
            return _Intended(listed if isinstance(listed, list) else [], True, confirmed=True)
        if isinstance(listed, list) and listed and cut_as_listed(messages, listed):
            return _Intended(listed, replayed=True, confirmed=False)
        await self._migration.update_one({"_id": record_id}, {"$set": {COPY_PIECES: pieces}})
        return _Intended(pieces, replayed=True, confirmed=False)

    async def _record_copy(self, record_id: str, pieces: list[dict[str, Any]]) -> None:
        """Confirm the record of a copy once the copy is written (`COPY_WRITTEN`): a copy gone
        is then one deleted since. A record removed meanwhile is written again whole, listing
        the legacy turns of the copy (`COPY_PIECES`), never without them."""
        created = {"kind": COPY_RECORD, COPY_PIECES: pieces}
        update = {"$set": {COPY_STATE: COPY_WRITTEN}, "$setOnInsert": created}
        await self._migration.update_one({"_id": record_id}, update, upsert=True)

    async def _unless_deleted(
        self, conversation: Conversation, written: Sequence[dict[str, Any]]
    ) -> None:
        """Take back the legacy turns just `written` when their conversation is gone: deleted,
        or deleted and created again under its id (another epoch: `same_conversation`) since
        the turn was reserved. A delete takes the ones written before its end
        (`delete_dual_writes`)."""
        same = same_conversation(
            conversation.id, epoch=conversation.epoch, created_at=conversation.created_at
        )
        still = await self._conversations.find_one(same, {"_id": 1})
        if still is None and written:
            named = scalar_filter("conversation_id", {"$eq": written[0]["conversation_id"]})
            await self._turns.delete_many({"_id": {"$in": [d["_id"] for d in written]}, **named})

    async def delete_dual_writes(
        self,
        conversation_id: str,
        *,
        owner: str | None,
        legacy_id: str | None = None,
        legacy_user_id: str | None = None,
    ) -> int:
        """Delete the turns dual-written under the conversation for `owner`: the delete's
        last step, for a turn stored before the delete whose dual write landed while it ran
        (one round trip); how many went. `legacy_id` is the legacy id a derived id stands
        for (its document's `legacy_conversation_id`), which its dual writes name;
        `legacy_user_id` its document's, the id they name a derived owner by."""
        named = [conversation_id]
        if (original := legacy_id_of(conversation_id, legacy_id)) is not None:
            named.append(original)
        owners = [owner, copied_user(owner, legacy_user_id)]
        with storage_errors("delete the legacy turns"):
            deleted = await self._turns.delete_many(
                {
                    **scalar_filter("conversation_id", {"$in": named}),
                    "dual_write": True,
                    "user_id": {"$in": owners},
                }
            )
        return int(deleted.deleted_count)


class _Intended(NamedTuple):
    """What a copy's record said when the dual write recorded it intended
    (`LegacyTurns._intend_copy`): the legacy turns the copy is written as, whether the record
    stood already (the turn a replay), and whether it stood confirmed (`COPY_WRITTEN`)."""

    listed: list[dict[str, Any]]
    replayed: bool
    confirmed: bool


def turn_copy(
    conversation: Conversation,
    turn_id: str,
    messages: Sequence[AgentMessage],
    max_bytes: int | None = None,
    *,
    listed: Sequence[Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The legacy turn documents the dual write copies a logged turn of `conversation` as
    (`legacy_turn_documents`): naming the conversation and its owner as its legacy turns do,
    cut as the copy's record lists them (`listed`) when it does, else a fork's copies cut
    where the turns of its original began; with `max_bytes`, each fits."""
    return legacy_turn_documents(
        conversation.id,
        turn_id,
        messages,
        user_id=copied_user_id(conversation),
        name=conversation.name,
        legacy_id=legacy_id_of(conversation.id, conversation.legacy_conversation_id),
        starts=_copied_turn_starts(turn_id, conversation),
        listed=listed,
        max_bytes=max_bytes,
    )


def turn_copy_pieces(
    conversation: Conversation,
    turn_id: str,
    messages: Sequence[AgentMessage],
    *,
    starts: Collection[int] = (),
) -> list[dict[str, Any]]:
    """The legacy turns `turn_copy` writes for a turn no record lists yet, as the record of
    the copy lists them (`copy_pieces`: each `_id` and the first and last `seq` it holds),
    cut at `starts` too (where a copy standing was cut: `piece_starts`)."""
    cut = {*_copied_turn_starts(turn_id, conversation), *starts}
    return copy_pieces(conversation.id, turn_id, messages, starts=cut)


def _copied_turn_starts(turn_id: str, conversation: Conversation) -> list[int]:
    """Where the turns of a fork's original began among the fork's copies (`seq`s), when the
    turn is those copies; none for any other turn."""
    origin = conversation.forked_from
    if origin is None or turn_id != fork_turn_id(origin.conversation_id, origin.seq):
        return []
    return list(origin.turn_starts)


def copied_user_id(conversation: Conversation) -> str | None:
    """The user a conversation's dual-written turns name (`copied_user`)."""
    return copied_user(conversation.user_id, conversation.legacy_user_id)


def copied_user(user_id: str | None, recorded: Any) -> str | None:
    """The user id a dual-written turn names its user by, as the legacy turns name them: for
    the user the migration derived from a legacy id (`derived_user_id`), that legacy id as
    the conversation's document records it (`legacy_user_id`), checked to derive it, never
    guessed; any other user id as it is (and a derived one with no id recorded: a
    conversation migrated before it was recorded)."""
    if user_id is None or not isinstance(recorded, str) or derived_user_id(recorded) != user_id:
        return user_id
    return recorded


def legacy_id_of(conversation_id: str, recorded: Any) -> str | None:
    """The legacy id a conversation stored under a derived `legacy-conversation-` id stands
    for, as its document records it (`legacy_conversation_id`); None for any other id."""
    if not conversation_id.startswith(DERIVED_CONVERSATION_PREFIX):
        return None
    return recorded if isinstance(recorded, str) else None  # a number's name (1e300) too


def turns_known_as(
    conversation_id: str, original: str | None, made_of: Sequence[Any] = ()
) -> dict[str, Any]:
    """The legacy turns the store knows as `conversation_id`, `original` the legacy id a
    derived `legacy-conversation-` id stands for (`LegacyTurns._original_id`), `made_of`
    the `_id`s of the turns naming no conversation a `legacy-turn-` id stands for
    (`Unnamed.ids`).

    The migration names a conversation by its legacy id as text (an ObjectId or a
    number too), a turn naming none by a derived `legacy-turn-` id (its `_id`, hashed
    when that is not a short identifier, told apart from another's reading alike:
    `tell_apart`), and a legacy id that is not an identifier by a derived
    `legacy-conversation-` id.
    """
    if conversation_id.startswith(DERIVED_TURN_PREFIX):
        # turns dual-written under the id
        clauses = [scalar_filter("conversation_id", {"$eq": conversation_id})]
        if made_of:
            own = {"$and": [{"_id": {"$in": list(made_of)}}, names_none("conversation_id")]}
            clauses.insert(0, own)
        return {"$or": clauses}
    if original is not None:
        return {
            "$or": [
                scalar_filter("conversation_id", {"$eq": conversation_id}),
                id_filter("conversation_id", original),
            ]
        }
    return id_filter("conversation_id", conversation_id)


def _prompts_filter(conversation_id: str, original: str | None) -> dict[str, Any]:
    """The `session_hitl` prompts of the conversation the store knows as `conversation_id`:
    those naming it, and those naming the legacy id a derived id stands for."""
    if original is None:
        return prompts_filter(conversation_id)
    return {"$or": [prompts_filter(conversation_id), prompts_filter(original)]}


def _conversations_named(turns: list[dict[str, Any]]) -> list[Any]:
    """The conversation ids the turns name, each once (by BSON value: an object id is no
    dict key), those naming none left out."""
    named = {bson.encode({"id": t.get("conversation_id")}): t for t in turns}
    return [t["conversation_id"] for t in named.values() if named_id(t.get("conversation_id"))]


def _of_records(recorded: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A filter of the legacy turns these claim records are of (`CLAIM_RECORD`), in a list
    (empty for none: a query never sends an empty `$in`)."""
    return _among_ids([r["turn_id"] for r in recorded if "turn_id" in r])


def _claimed_from(document: Mapping[str, Any]) -> list[Any]:
    """The user ids claims moved a legacy turn document away from (`CLAIMED_FROM`), in
    order; none for a turn no claim moved."""
    moved = document.get(CLAIMED_FROM)
    return list(moved) if isinstance(moved, list) else []


def _naming_query(user_id: str) -> dict[str, Any]:
    """A filter of every document naming `user_id` (`_naming`), and more: those found by the
    values `user_values` lists, and for a derived user every value that may be no identifier
    (`may_not_be_identifiers`)."""
    query: dict[str, Any] = {"user_id": {"$in": user_values(user_id)}}
    if user_id.startswith(DERIVED_USER_PREFIX):
        query = {"$or": [query, may_not_be_identifiers("user_id")]}
    return query


class UsersTurns(NamedTuple):
    """The legacy turns an erasure starts from (`LegacyTurns._users_turns`)."""

    naming: list[dict[str, Any]]
    """Those naming the user (`_naming`)."""
    under: list[dict[str, Any]]
    """Those under the ids of her conversations stored here, whatever they name."""
    stored: dict[str, LiveConversation]
    """Her conversations stored here, by the ids their legacy turns name (`_stored_lives`)."""


def _among_ids(ids: list[Any]) -> list[dict[str, Any]]:
    """A filter of the documents whose `_id` is one of `ids`, in a list (empty for none: a
    query never sends an empty `$in`)."""
    return [{"_id": {"$in": ids}}] if ids else []


LATE_TURNS: dict[str, Any] = {field: {"$exists": False} for field in CONVERSATION_COUNTERS}
"""Legacy turns in `agent_conversations`: an old-service writer still running logs them there
after the migration's move (or before it, with the service started early), where `run`
moves them aside. Every document with neither counter of a conversation document, as the
migration tells them (`TURN_FILTER`): an erasure takes those naming the user, a claim moves
them, as it does the legacy collection's."""


def _parts_of(
    late: list[dict[str, Any]],
    owner: str | None,
    *,
    unnamed: bool,
    beside: Mapping[str, list[LegacyTurn]],
) -> list[Any]:
    """The `_id`s of the `late` legacy turns that are `owner`'s part of their conversation:
    those naming `owner` as their conversation's turns read them (`_users_of`: a user id a
    claim moved the conversation away from names its claimer), and, where `owner` owns the
    conversation (`unnamed`: `owns_legacy`), those naming no user, as in the legacy
    collection, which a later run would migrate back with the owner's words; another
    user's stay."""
    parts = (owner, None) if unnamed else (owner,)
    users = _users_of(late, beside)
    return [d["_id"] for d, user in zip(late, users, strict=True) if user in parts]


def _parsed_by_name(documents: list[dict[str, Any]]) -> dict[str, list[LegacyTurn]]:
    """Legacy turn documents as models (`parse_turns`), by the conversation each names
    (`_named_apart`); those naming none left out."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for document in documents:
        if (name := _named_apart(document)) is not None:
            by_name.setdefault(name, []).append(document)
    return {name: parse_turns(docs) for name, docs in by_name.items()}


def _named_apart(document: Mapping[str, Any]) -> str | None:
    """The conversation a legacy turn document names (`named_id`), None for one whose
    `conversation_id` holds a database reference (`reference_in`), which names none to a
    reader (`parse_turns` refuses it): judged by the user it names, never refused by an
    erasure or a delete."""
    conversation = document.get("conversation_id")
    return None if reference_in(conversation) is not None else named_id(conversation)


def _users_of(
    documents: list[dict[str, Any]],
    beside: Mapping[str, list[LegacyTurn]],
    *,
    prompts: bool = False,
) -> list[str | None]:
    """The user each legacy turn document names (`user_named`), read as its conversation's
    turns read it (`turn_users`): a user id a claim moved the conversation away from names
    its claimer (`claimers` of the conversation's turns `beside` it, by name, read already,
    and of the documents under the same name). The one reading a delete and an erasure take
    of a late turn and of a turn naming the user, as the read fallback and `run` take it
    (was: the user it names, so the claimer's delete left a late turn naming the old id,
    which the next run brought back under it, and the old id's erasure took a turn the read
    fallback served the claimer). `prompts`: the documents are `session_hitl` prompts, each
    of the conversation `prompt_conversation` names, recording no claim. No round trip."""
    users = [user_named(d.get("user_id")) for d in documents]
    name_of = prompt_conversation if prompts else _named_apart
    by_name: dict[str, list[int]] = {}
    for index, document in enumerate(documents):
        if (name := name_of(document)) is not None:
            by_name.setdefault(name, []).append(index)
    for name, indexes in by_name.items():
        own = [] if prompts else parse_turns(documents[i] for i in indexes)
        claimed = claimers([*beside.get(name, []), *own])
        for i in indexes:
            document = documents[i]
            users[i] = claimed_user(document.get("user_id"), claimed, document.get(CLAIMED_FROM))
    return users


def _theirs(
    documents: list[dict[str, Any]],
    user_id: str,
    beside: Mapping[str, list[LegacyTurn]],
    *,
    prompts: bool = False,
) -> list[Any]:
    """The `_id`s of the `documents` that are `user_id`'s as their conversations' turns read
    them (`_users_of`): what a claim moves and an erasure takes as naming the user."""
    users = _users_of(documents, beside, prompts=prompts)
    return [d["_id"] for d, user in zip(documents, users, strict=True) if user == user_id]


def _counted_once(deleted: Any, stranded: Any, late: list[Any], taken: list[Any]) -> int:
    """How many legacy turns went: those deleted from the legacy collection (of `taken`),
    and those of the `late` ones (each `_id` once, however often listed) deleted from
    `agent_conversations` that the legacy collection did not hold too (a run moving them
    aside had copied them, not yet deleted them: one turn, taken from both, counted once)."""
    gone = 0 if deleted is None else int(deleted.deleted_count)
    if stranded is None:
        return gone
    copied = {bson.encode({"_id": i}) for i in taken}
    apart = {bson.encode({"_id": i}) for i in late} - copied  # an `_id` listed twice: once
    return gone + min(int(stranded.deleted_count), len(apart))


def _late_of(ids: list[Any]) -> dict[str, Any]:
    """The late legacy turns (`LATE_TURNS`) among `ids`: a conversation document under one
    of them since (an `_id` a turn and a conversation may share) is left alone."""
    return {"_id": {"$in": ids}, **LATE_TURNS}
