"""Legacy turns as a claim left them: a claim records each turn it moves in the migration's
collection (`CLAIM_RECORD`), where the old service never writes, so a moved turn the old
service saves again from its cache is the claimer's to `run`, `verify` and `finish` as it is
to the store."""

from __future__ import annotations

from typing import Any

from pymongo.database import Database

from agent_store.legacy import MIGRATION_STATE, as_claims_recorded, claim_records_owed


def claims_recorded(
    db: Database[dict[str, Any]], documents: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Legacy turn documents as their claim records say (`as_claims_recorded`), as the store
    reads them: a moved turn the old service saved again from its cache (the user id it knew,
    no `claimed_from`) is the claimer's. One lookup, only when one of them carries a claim
    (`claim_records_owed`): a read of turns no claim moved costs nothing more."""
    owed = claim_records_owed(documents)
    if not owed:
        return documents
    records = list(db[MIGRATION_STATE].find({"_id": {"$in": owed}}))
    return as_claims_recorded(documents, records)
