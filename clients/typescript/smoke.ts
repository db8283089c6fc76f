// The Node smoke test: what a TypeScript admin app sees of the example conversation, read
// from the collections with the official MongoDB driver and from the admin API with `fetch`
// through the typed functions of example.ts, every document and payload validated against
// the published JSON Schemas (schemas/). tests/test_node_client.py starts the service
// (`python -m app`, embedded database and demo data) and runs this file.
//
// Environment: MONGODB_URI, API_BASE, API_TOKEN, CONVERSATION_ID, USER_ID, SCHEMA_DIR.
// It prints one line per check and exits with 1 if any failed.
import { readFileSync, readdirSync } from "node:fs";
import { isDeepStrictEqual } from "node:util";
import { join } from "node:path";

import Ajv2020 from "ajv/dist/2020";
import addFormats from "ajv-formats";
import { BSON, MongoClient, type Db, type Document } from "mongodb";

import type { AgentMessageByRole, AgentMessageDocument } from "./agent-message";
import {
  AdminApi,
  ApiError,
  conversationTitles,
  lastActive,
  messagesById,
  messagesByRole,
  pendingQuestion,
  positions,
  storedConversation,
  storedTranscript,
  transcriptLines,
} from "./example";

const env = (name: string): string => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};

// -- checks ------------------------------------------------------------------------------

const failures: string[] = [];
let passed = 0;

function check(finding: string, what: string, ok: boolean, detail = ""): void {
  if (ok) {
    passed += 1;
    console.log(`ok    [${finding}] ${what}`);
  } else {
    failures.push(`[${finding}] ${what}${detail ? `: ${detail}` : ""}`);
    console.log(`FAIL  [${finding}] ${what}${detail ? `: ${detail}` : ""}`);
  }
}

async function attempt<T>(finding: string, what: string, run: () => Promise<T>): Promise<T | null> {
  try {
    const result = await run();
    check(finding, what, true);
    return result;
  } catch (error) {
    const name = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
    check(finding, what, false, name);
    return null;
  }
}

// -- schemas -----------------------------------------------------------------------------

type Schema = Record<string, unknown>;

function loadSchemas(dir: string): Map<string, Schema> {
  const schemas = new Map<string, Schema>();
  for (const form of ["api", "stored"]) {
    for (const file of readdirSync(join(dir, form)).filter((f) => f.endsWith(".schema.json"))) {
      const name = `${form}/${file.replace(".schema.json", "")}`;
      schemas.set(name, JSON.parse(readFileSync(join(dir, form, file), "utf8")) as Schema);
    }
  }
  return schemas;
}

const ajv = new Ajv2020({ strict: true, allErrors: true, discriminator: true });
addFormats(ajv);

function validator(schemas: Map<string, Schema>, name: string): (value: unknown) => string | null {
  const schema = schemas.get(name);
  if (schema === undefined) return () => `no published schema ${name}.schema.json`;
  let validate: ReturnType<typeof ajv.compile>;
  try {
    validate = ajv.compile(schema);
  } catch (error) {
    return () => `${name}.schema.json does not compile: ${String(error)}`;
  }
  return (value) => (validate(value) ? null : ajv.errorsText(validate.errors, { separator: "; " }));
}

function conforms(finding: string, schemas: Map<string, Schema>, name: string, values: unknown[]): void {
  const validate = validator(schemas, name);
  const errors = values.map((v, i) => [i, validate(v)] as const).filter(([, e]) => e !== null);
  check(
    finding,
    `${values.length} value(s) conform to ${name}.schema.json`,
    values.length > 0 && errors.length === 0,
    errors.slice(0, 3).map(([i, e]) => `#${i}: ${e}`).join(" | "),
  );
}

/** Every `type: integer` node of a schema (and its `$defs`). */
function integerNodes(schema: unknown, path = "#"): [string, Schema][] {
  if (Array.isArray(schema)) return schema.flatMap((item, i) => integerNodes(item, `${path}/${i}`));
  if (schema === null || typeof schema !== "object") return [];
  const node = schema as Schema;
  const own: [string, Schema][] = node.type === "integer" ? [[path, node]] : [];
  return [...own, ...Object.entries(node).flatMap(([k, v]) => integerNodes(v, `${path}/${k}`))];
}

// -- values ------------------------------------------------------------------------------

const ISO = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}/;

/** Every string that reads as a time, with where it is. */
function timeStrings(value: unknown, path = "$"): [string, string][] {
  if (typeof value === "string") return ISO.test(value) ? [[path, value]] : [];
  if (Array.isArray(value)) return value.flatMap((item, i) => timeStrings(item, `${path}[${i}]`));
  if (value !== null && typeof value === "object") {
    return Object.entries(value).flatMap(([k, v]) => timeStrings(v, `${path}.${k}`));
  }
  return [];
}

/** Paths of canonical Extended JSON int32 values (`{"$numberInt": …}`) outside HITL params. */
function int32Paths(value: unknown, path = "$"): string[] {
  if (Array.isArray(value)) return value.flatMap((item, i) => int32Paths(item, `${path}[${i}]`));
  if (value === null || typeof value !== "object") return [];
  if (path.endsWith(".params")) return [];
  const entries = Object.entries(value);
  if (entries.length === 1 && entries[0]?.[0] === "$numberInt") return [path];
  return entries.flatMap(([k, v]) => int32Paths(v, `${path}.${k}`));
}

/** A document as the API serves it: times as strings, the store's bookkeeping left out. */
function asServed(document: Document): unknown {
  const { turns: _t, turns_dropped: _d, inbox: _i, epoch: _e, ...served } = document;
  return JSON.parse(JSON.stringify(served));
}

// -- the run -----------------------------------------------------------------------------

async function readCollections(db: Db, conversationId: string, schemas: Map<string, Schema>) {
  const collections = await attempt("1", "listCollections", async () =>
    (await db.listCollections().toArray()).map((c) => c.name),
  );
  check("1", "both collections are listed", !!collections?.includes("agent_messages") &&
    collections.includes("agent_conversations"), String(collections));
  const conversation = await attempt("1", "findOne a conversation", () =>
    storedConversation(db, conversationId),
  );
  const messages = await attempt("1", "find its messages in batches of 5 (getMore)", () =>
    storedTranscript(db, conversationId, 5),
  );
  const count = await attempt("1", "countDocuments", () =>
    db.collection("agent_messages").countDocuments({ conversation_id: conversationId }),
  );
  const roles = await attempt("1", "aggregate", () => messagesByRole(db, conversationId));
  check("1", "the reads agree", messages !== null && count === messages.length &&
    Object.values(roles ?? {}).reduce((a, b) => a + b, 0) === count, `${count} ${messages?.length}`);
  if (conversation === null || messages === null) return null;
  check("1", "the conversation reads as a document", lastActive(conversation).length > 0);

  // [2] stored messages hold their ids, `seq` and turn, typed so.
  const byId = messagesById(messages);
  const seqs = positions(messages);
  check("2", "every stored message has an _id, a conversation, a turn", byId.size === messages.length &&
    messages.every((m) => typeof m._id === "string" && m.conversation_id === conversationId &&
      typeof m.turn_id === "string"));
  check("2", "seq runs 0…n-1", isDeepStrictEqual(seqs, messages.map((_, i) => i)), String(seqs));
  check("2", "created_at is a Date", messages.every((m) => m.created_at instanceof Date));

  // [6] the same documents with their BSON types: canonical Extended JSON.
  const raw = {
    conversation: await db.collection("agent_conversations")
      .findOne({ _id: conversationId } as Document, { promoteValues: false }),
    messages: await db.collection("agent_messages")
      .find({ conversation_id: conversationId }, { promoteValues: false }).sort({ seq: 1 }).toArray(),
  };
  const canonical = (d: Document | null) => BSON.EJSON.serialize(d, { relaxed: false });
  conforms("2,4,6", schemas, "stored/agent-conversation", [canonical(raw.conversation)]);
  conforms("2,4,6", schemas, "stored/agent-message", raw.messages.map(canonical));
  const narrow = [raw.conversation, ...raw.messages].flatMap((d) => int32Paths(canonical(d)));
  check("6", "every stored integer is an int64", narrow.length === 0, narrow.slice(0, 5).join(", "));
  return { conversation, messages };
}

async function readApi(
  api: AdminApi,
  ids: { conversation: string; user: string },
  stored: { messages: AgentMessageDocument[] } | null,
) {
  const served: [string, unknown][] = [];
  const got = async <T>(finding: string, schema: string, what: string, run: () => Promise<T>) => {
    const value = await attempt(finding, what, run);
    if (value !== null) served.push([schema, value]);
    return value;
  };
  await got("3", "health", "GET /health", () => api.health());
  await got("3", "readiness", "GET /ready", () => api.ready());
  const page = await got("3", "conversation-page", "GET conversations", () => api.conversations(ids.user, 50));
  const conversation = await got("3", "agent-conversation", "GET conversation", () => api.conversation(ids.conversation));
  const transcript = await got("3", "transcript", "GET transcript", () => api.transcript(ids.conversation));
  const first = await got("3", "message-page", "GET messages (page 1)", () => api.messages(ids.conversation, 5));
  if (first?.last_id) {
    await got("3", "message-page", "GET messages (page 2)", () =>
      api.messages(ids.conversation, 5, first.last_id ?? undefined));
  }
  await got("3", "pending-hitl-state", "GET hitl", () => api.pendingHitl(ids.conversation));
  await got("3", "search-results", "GET search", () => api.search("Lyon", ids.user));
  const exported = await got("3", "user-export", "GET export (json)", () => api.exportUser(ids.user));
  const lines = await attempt("3", "GET export (jsonl)", () => api.exportUserLines(ids.user));
  for (const line of lines ?? []) served.push(["conversation-export", line]);
  check("3", "both export formats hold the same conversations", lines !== null && exported !== null &&
    isDeepStrictEqual(lines, exported.conversations));
  if (transcript) check("3", "the transcript reads", transcriptLines(transcript).length > 1);
  if (page) check("3", "the list reads", conversationTitles(page).length === page.data.length);

  // [7] A list item is the conversation as its own route serves it.
  const item = page?.data.find((c) => c._id === ids.conversation);
  check("7", "the list item equals the conversation route's answer", item !== undefined &&
    isDeepStrictEqual(item, conversation), JSON.stringify(item).slice(0, 200));

  // [5] Served times equal the stored ones, in toISOString()'s one format.
  if (transcript && stored) {
    const same = transcript.data.every((m, i) =>
      m.created_at === stored.messages[i]?.created_at.toISOString() &&
      isDeepStrictEqual(m, asServed(stored.messages[i] as Document)));
    check("5", "the API serves each stored message as it is stored, times as toISOString()", same);
  }
  return { served, transcript, conversation };
}

async function writeThroughApi(api: AdminApi, served: [string, unknown][]) {
  const owner = `smoke-${Date.now()}`;
  const id = `${owner}-conversation`;
  const at = new Date(Date.UTC(2026, 2, 3, 8, 0, 0, 120)).toISOString();
  const turn = {
    user_id: owner,
    turn_id: "smoke-turn-1",
    messages: [
      { role: "user", content: "Book a table for two", created_at: at },
      {
        role: "assistant",
        content: "Which evening?",
        hitl_action: { action: "choose_date", params: { options: [1, 2] }, request_id: "req-1" },
        token_usage: { input_tokens: 12, output_tokens: 4 },
        latency_ms: 250,
        created_at: at,
      },
    ],
  };
  const logged = await attempt("3", "POST a turn", () => api.logTurn(id, turn));
  if (logged) served.push(["logged-turn", logged]);
  const state = await attempt("3", "GET its pending prompt", () => api.pendingHitl(id));
  if (state) served.push(["pending-hitl-state", state]);
  check("3", "the pending prompt reads", !!state && !!pendingQuestion(state)?.startsWith("choose_date"));
  const resolved = await attempt("3", "POST hitl/resolve", () => api.resolveHitl(id, "req-1"));
  if (resolved) served.push(["hitl-resolved", resolved]);
  const renamed = await attempt("3", "PATCH rename", () => api.rename(id, "Dinner"));
  if (renamed) served.push(["agent-conversation", renamed]);
  const claimed = await attempt("3", "POST a claim", () => api.claim(owner, `${owner}-b`));
  if (claimed) served.push(["claimed", claimed]);
  const deleted = await attempt("3", "DELETE the conversation", () => api.delete(id));
  if (deleted) served.push(["deleted", deleted]);
  const erased = await attempt("3", "DELETE the user", () => api.eraseUser(`${owner}-b`));
  if (erased) served.push(["deleted", erased]);
  try {
    await api.conversation(id);
    check("3", "a deleted conversation is a 404 error body", false, "it was found");
  } catch (error) {
    check("3", "a deleted conversation is a 404 error body", error instanceof ApiError && error.status === 404);
    if (error instanceof ApiError) served.push(["api-error-body", error.body]);
  }

  // [6] JavaScript holds 2**53 - 1 exactly and no integer above it: such a turn is refused.
  const tooBig = { ...turn, turn_id: "smoke-turn-2", messages: [{ ...turn.messages[1], latency_ms: 2 ** 53 }] };
  try {
    await api.logTurn(`${id}-big`, { ...tooBig, user_id: owner });
    check("6", "latency_ms 2**53 is refused", false, "it was stored");
  } catch (error) {
    check("6", "latency_ms 2**53 is refused", error instanceof ApiError && error.status === 422 &&
      error.body.error.message.includes("latency_ms"), String(error));
  }
  return logged?.messages ?? [];
}

function schemasAreStrict(schemas: Map<string, Schema>, message: AgentMessageByRole<string>[],
  conversation: unknown): void {
  // [4] Every key is required, and a role's forbidden fields are null.
  const validateMessage = validator(schemas, "api/agent-message");
  // A refusal means something only if the unchanged values are accepted.
  const control = message.map(validateMessage).filter((e) => e !== null);
  check("4", "the served messages conform as they are", message.length > 0 && control.length === 0,
    control[0] ?? "");
  const keysOptional = message.flatMap((m) => Object.keys(m).filter((key) => {
    const { [key]: _dropped, ...rest } = m as unknown as Record<string, unknown>;
    return validateMessage(rest) === null;
  }).map((key) => `${m.role}.${key}`));
  check("4", "a served message missing any key is refused", control.length === 0 &&
    message.length > 0 && keysOptional.length === 0,
    [...new Set(keysOptional)].slice(0, 8).join(", "));
  const samples: Record<string, unknown> = {
    tool_calls: [{ id: "c1", type: "function", function: { name: "f", arguments: "{}" } }],
    tool_call_id: "c1",
    hitl_action: { action: "a", params: {}, request_id: "r" },
    upload: { filename: "a.txt", file_type: "text/plain", size: 1, parsed_text: null },
    token_usage: { input_tokens: 1, output_tokens: 1 },
  };
  const forbidden: Record<string, string[]> = {
    system: ["tool_calls", "tool_call_id", "hitl_action", "token_usage"],
    user: ["tool_calls", "tool_call_id", "hitl_action", "token_usage"],
    assistant: ["tool_call_id", "upload"],
    tool: ["tool_calls", "hitl_action", "upload", "token_usage"],
  };
  const accepted: string[] = [];
  for (const m of message) {
    for (const field of forbidden[m.role] ?? []) {
      if (validateMessage({ ...m, [field]: samples[field] }) === null) accepted.push(`${m.role}.${field}`);
    }
  }
  const roles = new Set(message.map((m) => m.role));
  check("4", `a field its role forbids is refused (roles seen: ${[...roles].join(", ")})`,
    control.length === 0 && roles.size === 4 && accepted.length === 0, [...new Set(accepted)].join(", "));
  const validateConversation = validator(schemas, "api/agent-conversation");
  const record = (conversation ?? {}) as Record<string, unknown>;
  const conversationControl = validateConversation(record);
  check("4", "the served conversation conforms as it is", conversationControl === null,
    conversationControl ?? "");
  const optional = Object.keys(record).filter((key) => {
    const { [key]: _dropped, ...rest } = record;
    return validateConversation(rest) === null;
  });
  check("4", "a served conversation missing any key is refused", conversationControl === null &&
    Object.keys(record).length > 0 && optional.length === 0, optional.join(", "));
}

async function main(): Promise<void> {
  const ids = { conversation: env("CONVERSATION_ID"), user: env("USER_ID") };
  const schemas = loadSchemas(env("SCHEMA_DIR"));
  const client = new MongoClient(env("MONGODB_URI"), { serverSelectionTimeoutMS: 10_000 });
  let stored: Awaited<ReturnType<typeof readCollections>> = null;
  try {
    stored = await readCollections(client.db(process.env.DATABASE ?? "agent_store"), ids.conversation, schemas);
  } finally {
    await client.close();
  }
  const api = new AdminApi(env("API_BASE"), env("API_TOKEN"));
  const { served, transcript, conversation } = await readApi(api, ids, stored);
  const written = await writeThroughApi(api, served);

  const bySchema = new Map<string, unknown[]>();
  for (const [name, value] of served) bySchema.set(name, [...(bySchema.get(name) ?? []), value]);
  for (const [name, values] of bySchema) conforms("3,4,5,6", schemas, `api/${name}`, values);

  // [5] One time format: what toISOString() gives, so strings sort as the times do.
  const times = served.flatMap(([, value]) => timeStrings(value));
  const odd = times.filter(([, s]) => new Date(s).toISOString() !== s);
  check("5", `all ${times.length} served times are toISOString()'s format`, times.length > 0 &&
    odd.length === 0, odd.slice(0, 3).map(([p, s]) => `${p}=${s}`).join(", "));

  // [6] Every integer a schema describes is bounded to what JavaScript holds exactly.
  const unbounded = [...schemas].flatMap(([name, schema]) =>
    integerNodes(schema).filter(([, node]) =>
      typeof node.maximum !== "number" || node.maximum > Number.MAX_SAFE_INTEGER ||
      typeof node.minimum !== "number").map(([path]) => `${name}${path}`));
  check("6", "every integer of every schema is bounded to 2**53 - 1", unbounded.length === 0,
    unbounded.slice(0, 4).join(", "));

  schemasAreStrict(schemas, [...(transcript?.data ?? []), ...written], conversation);

  console.log(`\n${passed} passed, ${failures.length} failed`);
  if (failures.length > 0) {
    console.log(failures.map((f) => `  ${f}`).join("\n"));
    process.exitCode = 1;
  }
}

main().catch((error: unknown) => {
  console.error(error);
  process.exitCode = 2;
});
