// Declarations of the documents in `agent_messages` and `agent_conversations`
// and of every JSON response of the admin API, derived from the pydantic models
// (agent_store/core/_models.py, app/api_models.py) through the same JSON Schemas
// as schemas/. Do not edit: run `make types`; a test fails when this file is stale.
//
// Every key is present in every document and every API object; a missing
// value is `null`, never `undefined`. The few keys marked optional (`?`) are
// absent from documents stored before the version that added them (the API
// serves them always). Integers are at most 2**53 - 1.

/**
 * How a time reaches the reader.
 *
 * The collections hold BSON dates, which the Node.js driver returns as `Date`;
 * the API's JSON carries RFC 3339 strings in UTC with exactly three fractional
 * digits (`"2026-01-31T09:30:00.000Z"`, what `Date.prototype.toISOString()`
 * gives, so they sort as the times do). A type shared by both takes the type
 * of a time as the parameter `TDate`, with no default: write
 * `IAgentConversation<Date>` for a document (or `IAgentConversationDocument`) and
 * `IAgentConversation<string>` for the API's. The API's own responses
 * (`ITranscript`, `IMessagePage`, …) hold strings and take no parameter.
 */
export type DateLike = Date | string;

/** Who speaks a message, as in the OpenAI chat format. */
export type MessageRole = "system" | "user" | "assistant" | "tool";

/**
 * Any stored or served message, as one flat interface: every role has every field.
 *
 * Narrow to the role's own interface with `AgentMessageByRole`.
 */
export interface IAgentMessage<TDate extends DateLike> {
  /** Stable message id (extension), derived by the store from the turn: never a caller's. */
  _id: string;
  /** The conversation this message belongs to. Set by the logger. */
  conversation_id: string;
  role: MessageRole;
  content: string | null;
  /** At most 1,000 (`MAX_TOOL_CALLS`). */
  tool_calls: IToolCall[] | null;
  tool_call_id: string | null;
  hitl_action: IHitlAction | null;
  error: IMessageError | null;
  upload: IFileUpload | null;
  created_at: TDate;
  token_usage: ITokenUsage | null;
  latency_ms: number | null;
  /** Position in the conversation (extension). Assigned by the logger. */
  seq: number;
  /** The conversation's owner, denormalized (extension). Set by the logger. */
  user_id: string | null;
  /** The turn that logged this message (extension). Set by the logger. */
  turn_id: string;
  /** Text extracted at write time for full-text search (extension). */
  search_text: string | null;
  /**
   * Fields cut to keep the document bounded, by path, with where each is kept whole
   * (extension). A bare number is the older shape: the original length, not kept whole.
   */
  truncated: Record<string, ITruncation | number> | null;
  /**
   * The runtime's own form of the message where the chat fields cannot rebuild it
   * (extension; see `NativeForm`).
   */
  native: INativeForm | null;
}

/** Any message, told apart by `role`: `switch (message.role)` narrows it. */
export type AgentMessageByRole<TDate extends DateLike> =
  | ISystemMessage<TDate>
  | IUserMessage<TDate>
  | IAssistantMessage<TDate>
  | IToolMessage<TDate>;

/** A system prompt or a system-triggered turn. */
export interface ISystemMessage<TDate extends DateLike> extends IAgentMessage<TDate> {
  role: "system";
  /** Always `null` when `role` is `system`. */
  tool_calls: null;
  /** Always `null` when `role` is `system`. */
  tool_call_id: null;
  /** Always `null` when `role` is `system`. */
  hitl_action: null;
  /** Always `null` when `role` is `system`. */
  token_usage: null;
}

/** What the user typed or uploaded. */
export interface IUserMessage<TDate extends DateLike> extends IAgentMessage<TDate> {
  role: "user";
  /** Always `null` when `role` is `user`. */
  tool_calls: null;
  /** Always `null` when `role` is `user`. */
  tool_call_id: null;
  /** Always `null` when `role` is `user`. */
  hitl_action: null;
  /** Always `null` when `role` is `user`. */
  token_usage: null;
}

/** A model response: text, tool calls, a HITL prompt or an error. */
export interface IAssistantMessage<TDate extends DateLike> extends IAgentMessage<TDate> {
  role: "assistant";
  /** Always `null` when `role` is `assistant`. */
  tool_call_id: null;
  /** Always `null` when `role` is `assistant`. */
  upload: null;
}

/** The result of one tool call, answering it by `tool_call_id`. */
export interface IToolMessage<TDate extends DateLike> extends IAgentMessage<TDate> {
  role: "tool";
  /** Always `null` when `role` is `tool`. */
  tool_calls: null;
  /** Always `null` when `role` is `tool`. */
  hitl_action: null;
  /** Always `null` when `role` is `tool`. */
  upload: null;
  /** Always `null` when `role` is `tool`. */
  token_usage: null;
}

/** One conversation document. */
export interface IAgentConversation<TDate extends DateLike> {
  /** Equal to `conversation_id`. */
  _id: string;
  conversation_id: string;
  /** The owner; `null` for a conversation only services write to. */
  user_id: string | null;
  name: string | null;
  /** Who chose `name` (extension): automatic names yield to a runtime's, both to a person's. */
  name_source: "auto" | "runtime" | "set" | null;
  created_at: TDate;
  /**
   * The latest time of its messages, whatever their `seq` order (the last message's when
   * they are logged in time order), or `created_at` when later (a conversation holding none,
   * or created before its messages' times).
   */
  updated_at: TDate;
  turn_count: number;
  last_message_preview: string;
  /** The next free `seq` (extension). */
  message_count: number;
  pending_hitl: IPendingHitl<TDate> | null;
  /** Tool calls awaiting an answer from a later turn, oldest first (extension). */
  pending_calls: IPendingCall<TDate>[];
  usage: IUsage;
  /** The conversation and `seq` this one was forked from (extension); null if it was not. */
  forked_from: IForkOrigin | null;
  /**
   * The id its legacy turns named, when that was not an identifier and the migration gave
   * the conversation a derived one (extension).
   */
  legacy_conversation_id: string | null;
  /**
   * The legacy user id its owner was named by, when that was not an identifier and the
   * migration stored the conversation owned by the user derived from it (`legacy-user-`):
   * the dual write names that user by it, as the legacy turns do (extension). A claim
   * moving the conversation to another user clears it.
   */
  legacy_user_id: string | null;
}

/**
 * A document of `agent_messages`, as the Node.js driver returns it, with the store's
 * bookkeeping (absent on messages stored before it; read none of it).
 */
export type AgentMessageDocument = AgentMessageByRole<Date> & { epoch?: string | null; copy_owed?: boolean };

/**
 * A document of `agent_conversations`, as the Node.js driver returns it: what the API serves
 * and the store's bookkeeping, which the API never serves.
 */
export interface IAgentConversationDocument extends IAgentConversation<Date> {
  /**
   * The message an automatic name (`name_source` "auto") was taken from (the store's bookkeeping, never served; absent when no turn named the conversation so, or it was named before the store recorded it): a pop of that message takes the name back.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  name_message_id?: string | null;
  /**
   * The `version` of the conversation a LangGraph thread's copy logged turn by turn created this one to copy (`copy_thread`; the store's bookkeeping, never served): it tells the copy's earlier attempt from another copy's, or one of an earlier life of its source.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  copy_of?: string | null;
  /**
   * Set as a fork creates this conversation, cleared once the fork's check found its source whole (`ForkCheck`; the store's bookkeeping, never served): a fork still holding it has not stood yet.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  fork_check?: Record<string, unknown> | null;
  /**
   * Every logged turn in reservation order, up to `TurnRules.turns_recorded` (extension; the store's bookkeeping, never served).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  turns?: unknown[];
  /**
   * How many of the oldest turn records were dropped to keep the document bounded.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  turns_dropped?: number;
  /**
   * The newest call the bound of `pending_calls` pushed off (the store's bookkeeping, never served; absent while none was, or the list was cut by a build before it).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  calls_pushed_off?: Record<string, unknown> | null;
  /**
   * The first `seq` of the turn that assigned an owner to this conversation, unowned until then (the store's bookkeeping, never served; absent, 0, when no turn did): its messages before that `seq` were logged unowned and move to the owner with that turn (a retry of it moves them again).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  owned_from?: number;
  /**
   * Open steering inboxes of running turns, by turn (the store's bookkeeping, never served).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  inbox?: Record<string, unknown>;
  /**
   * The turns runtimes opened a steering inbox for, by turn key (`TurnRecord.key`), the newest 100 (the store's bookkeeping, never served): a user token starts no turn under their ids, the inbox open or closed since, so the runtime logs its own turn.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  runtime_turns?: unknown[];
  /**
   * When a delete or an erasure of this conversation began (the store's bookkeeping, never served; absent but while one is under way, or failed part-way until it is run again): no turn, retry or pop writes to it, and forks find it gone.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  deleting_since?: Date | null;
  /**
   * Set as `python -m migrations run` writes this conversation's document, cleared once its messages are all in (the store's bookkeeping, never served; absent on every other document): until then the conversation is read from its legacy turns, and a turn, a pop, a rename or a fork of it is refused as of one not migrated yet (409).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  migrating?: boolean | null;
  /**
   * The pop under way, if any (the store's bookkeeping, never served): the next pop finishes it first.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  popping?: Record<string, unknown> | null;
  /**
   * How many pops were finished: a pop marks its message only if none finished since it read the conversation (the store's bookkeeping, never served).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  pops?: number;
  /**
   * The `seq`s pops removed while a later turn had reserved past them, and those of the blocks turns moved away from, the newest `POPPED_SEQS_KEPT` (the store's bookkeeping, never served): gaps no turn holds, passed at once by tail readers, forks and pops, and given back with the `seq` below them.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  popped_seqs?: unknown[];
  /**
   * The messages pops removed, the newest `POPPED_MESSAGES_KEPT` (the store's bookkeeping, never served): a tail reader's `after` naming one reads on from its `seq`, and the retry of a pop in doubt answers its message only if this conversation lists it.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  popped_messages?: unknown[];
  /**
   * The request ids of the prompts `resolve_hitl` resolved, the newest `RESOLVED_PROMPTS_KEPT` (the store's bookkeeping, never served): a resolution leaves no message, so a rerun of the migration and a fork folding the messages read them here.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  resolved_hitl?: unknown[];
  /**
   * The prompts `resolve_hitl` resolved, by asking (`AnsweredPrompt`, one per answer, the newest `RESOLVED_PROMPTS_KEPT`; the store's bookkeeping, never served): a prompt asked again under the request id leaves `resolved_hitl`, but a pop of it, or a fork cut before it, brings back no prompt of that id asked before the answer.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  answered_prompts?: unknown[];
  /**
   * The calls a person's answer released, those still pending and the newest `RESOLVED_PROMPTS_KEPT` others (the store's bookkeeping, never served): they await their results, and a turn denying one is refused (`AnsweredBefore`), whatever becomes of the request id of the prompt that held it (dropped from `resolved_hitl`, asked again).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  approved_calls?: unknown[];
  /**
   * A random token drawn when the document is created, and by the first turn logged after an upgrade on one created before (the store's bookkeeping, never served): every message the conversation stores carries it, so a delete takes this conversation's messages and none of one created again under its id since, whoever created it.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  epoch?: string | null;
  /**
   * Created by a release whose integrations name the conversation's `epoch` on every document they keep beside it (a LangGraph thread's checkpoints; the store's bookkeeping, never served): only those naming its epoch are its own, never one naming only a creation time, which the caller starting a conversation chooses. False on one created before, whose documents named its creation time (`agent_store.store.ThreadLife`).
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  epoch_marks?: boolean;
  /**
   * Created by `python -m migrations run`, which drew its `epoch` as a live turn draws one (the store's bookkeeping, never served): while no turn is logged to it the document is the migration's to rewrite or remove (`migrations.writes.written_by_migration`), as one an earlier release migrated, which holds no epoch, is. False on every document the store creates.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  migrated?: boolean;
  /**
   * The blocks of the turns whose reservation listed pending state (calls left open, a prompt raised), until a later turn's reservation finds them passed (`PendingBlock`; the store's bookkeeping, never served; emptied while nothing is pending): that turn looks whether they hold a message, and one holding none (its writer died before its insert) has the pending state folded again from the stored messages.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  pending_blocks?: unknown[];
  /**
   * The pending calls a fold listed again though they were off the list (`CallRelisted`; the store's bookkeeping, never served; absent until a fold does): an answer to one, a turn's or a person's, first looks whether the answer of the turn whose block was passed as abandoned landed since, and is refused when one did.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  calls_relisted?: unknown[];
  /**
   * When a fold of the pending state from the stored messages, after a move or a give-back, could not be written (the conversation kept changing under it, or a turn below the end was still being written); null or absent when none is owed (the store's bookkeeping, never served). The next turn folds it after its insert, and a turn refused by its condition meanwhile is judged again once it is folded.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  refold_owed?: Date | null;
  /**
   * The greatest `step` a turn was logged with (`log_messages`; a LangGraph thread's checkpoint ids), the store's bookkeeping, never served: a new turn of an earlier step is refused, so the transcript ends as the runtime's latest step.
   *
   * The store's own: absent until it is used (a conversation created empty or by the migration has none); read none of it.
   */
  last_step?: string | null;
}

export interface IHealth {
  status: "ok";
}

export interface IReadiness {
  status: "ready";
  database: "reachable";
}

/** A page of a user's conversations, newest first. */
export interface IConversationPage {
  data: IAgentConversation<string>[];
  has_more: boolean;
  first_id: string | null;
  last_id: string | null;
  /** Pass as `cursor` to read the next page; null on the last page. */
  next_cursor: string | null;
}

/** How many documents a delete or an erase removed. */
export interface IDeleted {
  conversations: number;
  messages: number;
  legacy_turns: number;
}

export interface ITranscript {
  conversation_id: string;
  data: AgentMessageByRole<string>[];
}

/** A page of a conversation's messages. */
export interface IMessagePage {
  data: AgentMessageByRole<string>[];
  has_more: boolean;
  first_id: string | null;
  last_id: string | null;
  /**
   * The `seq` of a message reserved by a turn still being written: an ascending page stops
   * before it, so a reader following the conversation asks again with the same `after`.
   */
  pending_seq: number | null;
}

/** What `log_messages` stored. */
export interface ILoggedTurn {
  conversation_id: string;
  turn_id: string;
  messages: AgentMessageByRole<string>[];
  replayed: boolean;
}

export interface IInboxOpened {
  conversation_id: string;
  turn_id: string;
  open: true;
}

export interface IDelivery {
  delivered: boolean;
}

export interface IDelivered {
  data: AgentMessageByRole<string>[];
  has_more: boolean;
}

export interface IInboxClosing {
  closed: boolean;
  data: AgentMessageByRole<string>[];
  has_more: boolean;
}

export interface IPendingHitlState {
  pending: IPendingHitl<string> | null;
}

export interface IHitlResolved {
  request_id: string;
  resolved: true;
}

export interface ISearchResults {
  data: ISearchHit[];
  has_more: boolean;
  next_cursor: string | null;
}

/** One conversation with its whole transcript. */
export interface IConversationExport {
  conversation: IAgentConversation<string>;
  messages: AgentMessageByRole<string>[];
}

/** Everything stored for one user (the `json` export format). */
export interface IUserExport {
  user_id: string;
  conversations: IConversationExport[];
}

/** How many documents a claim moved to the new owner. */
export interface IClaimed {
  conversations: number;
  messages: number;
  legacy_turns: number;
}

/** The body of every error response. */
export interface IApiErrorBody {
  error: IApiErrorDetail;
}

export interface IApiErrorDetail {
  code: string;
  message: string;
}

/** A file the user uploaded with a message. */
export interface IFileUpload {
  filename: string;
  /** A media type (RFC 6838 bounds its two names at 127 characters each). */
  file_type: string;
  size: number;
  parsed_text: string | null;
}

/** Where a forked conversation came from (extension). */
export interface IForkOrigin {
  conversation_id: string;
  /** The last `seq` of the original the fork copied. */
  seq: number;
  /**
   * The fork's `seq`s where a turn of the original began, after the first: its copies are
   * one turn, and what they leave pending is folded turn by turn as the original logged them
   * (by a pop or a fork of the fork too).
   */
  turn_starts: number[];
  /**
   * The original's `version` as the fork read it (`Conversation.version`, its `ETag`; null
   * on a fork made before it was recorded): it names the life of the original the fork
   * copied, which no conversation started again under its id shares (copies keep their
   * original's times, so two lives copied from one conversation start alike).
   */
  version: string | null;
}

/** The function an assistant asks to call. */
export interface IFunctionCall {
  /** The tool's name. */
  name: string;
  /**
   * The arguments as a JSON string; a dict is accepted and serialized (NaN and the
   * infinities spelt `NaN`, `Infinity`, `-Infinity`, as Python's `json` reads them back).
   *
   * As in the OpenAI format, a string the model produced is kept as it is,
   * even when it is not valid JSON, so that a turn is never lost over it.
   */
  arguments: string;
}

/** A human-in-the-loop prompt the assistant raised. */
export interface IHitlAction {
  action: string;
  /**
   * Plain JSON values, nested at most `MAX_PARAMS_DEPTH` levels. A turn's prompt holding
   * an object with a text `$ref` beside an `$id` (MongoDB reads it back as a database
   * reference, a DBRef) is refused; one stored so before is read back as that object.
   */
  params: Record<string, unknown>;
  request_id: string;
  /**
   * The calls this prompt holds back, by their ids: of its turn, made before it, or else
   * the latest pending call of each id of an earlier turn; a later prompt naming one holds
   * it instead. None: the calls before it in its turn that no prompt holds, as before.
   */
  tool_call_ids: string[] | null;
}

/** An error the runtime reported instead of an answer. */
export interface IMessageError {
  message: string;
}

/**
 * A runtime's own form of a message, kept as its difference from the form the message's
 * chat fields rebuild (extension), so that runtime gets back exactly what it stored.
 *
 * The runtime's form is the rebuilt one with `set` applied and the keys in `unset`
 * removed. An item the chat format has no place for (an Agents SDK reasoning item, a
 * web search or computer-use call) is an assistant message with no content whose `set`
 * holds the whole item; only the runtime named by `format` is given it back.
 */
export interface INativeForm {
  /**
   * Whose form: `openai-agents` (an Agents SDK item), `langchain` (a LangChain message) or
   * `pydantic-ai` (a response's several texts as content parts, its parts' order with the
   * parts the chat fields cannot hold; a system prompt's fields beyond its text; whether a
   * tool result's or retry feedback's content was a `str` or a value, a tool's kind).
   */
  format: string;
  /** Top-level keys whose values the rebuilt form lacks or holds otherwise; plain JSON. */
  set: Record<string, unknown>;
  /** Keys of the rebuilt form that the runtime's form does not have. */
  unset: string[];
  /**
   * Keys of `set` whose value is kept as its JSON text, as a call's arguments are: a value
   * holding, at any depth, what BSON would not give back as it is: a number it cannot hold
   * as it is (an integer outside 64 bits, NaN or an infinity, spelt `NaN`, `Infinity`,
   * `-Infinity`), or an object it reads back as a database reference (a text `$ref` beside
   * an `$id`, as a JSON Schema may hold). The runtime is given the value
   * the text spells (`set_values`), the one it stored.
   *
   * Absent on documents stored before 0.2.0, read as the default (the API serves it always).
   */
  json_text?: string[];
}

/**
 * A tool call left without an answer, awaiting one from a later turn (extension).
 *
 * Its turn ended with the call open: it awaits a person's approval or
 * confirmation, or a result computed elsewhere. The `tool` message a later
 * turn logs for it is its answer, and it is then no longer pending.
 */
export interface IPendingCall<TDate extends DateLike> {
  tool_call_id: string;
  tool_name: string;
  /** The assistant message that made the call. */
  message_id: string;
  /**
   * The HITL prompt that holds the call back: the first one its turn raised after it (or a
   * later one naming it). Once a person resolved that prompt by request id (`resolve_hitl`:
   * its id is then among the conversation's `resolved_hitl`), the call awaits its result and
   * the store serves null here.
   */
  request_id: string | null;
  /** When the call was made. */
  created_at: TDate;
  /**
   * The `seq` of the message that made the call, which orders the list as the calls were
   * made (the store's bookkeeping: null on a call listed before it was recorded).
   */
  seq: number | null;
}

/** The unresolved HITL prompt of a conversation (extension). */
export interface IPendingHitl<TDate extends DateLike> {
  request_id: string;
  action: string;
  params: Record<string, unknown>;
  /** The assistant's text that asked the question. */
  prompt: string | null;
  /** The assistant message that raised it. */
  message_id: string;
  created_at: TDate;
  /**
   * The fields served cut, as their message was cut to bound it (its `truncated` map): the
   * conversation's copy keeps them cut; `ConversationStore.pending_hitl` reads them back whole
   * (and lists here only a field whose whole text is not found).
   */
  truncated: ("params" | "prompt")[] | null;
}

/** One message that matched a search, with its relevance. */
export interface ISearchHit {
  message: AgentMessageByRole<string>;
  rank: number;
}

/** Tokens one model response used. */
export interface ITokenUsage {
  input_tokens: number;
  output_tokens: number;
}

/** One tool call of an assistant message. */
export interface IToolCall {
  /** Unique within the conversation; a `tool` message answers it by this id. */
  id: string;
  type: "function";
  function: IFunctionCall;
}

/** Where a text cut to bound its message is kept whole (extension). */
export interface ITruncation {
  /** The text's original length, in characters. */
  length: number;
  /**
   * The GridFS file (bucket `agent_message_blobs`) holding the whole text; None when it
   * was not kept (`search_text`, which is derived from the other fields).
   */
  blob_id: string | null;
  /**
   * The SHA-256 of the whole text as the file holds it (UTF-8), in hex: the message's
   * content digest covers the whole text, not only the part kept. None when the text was
   * not kept, or was cut before the store recorded it.
   *
   * Absent on documents stored before 0.2.0, read as the default (the API serves it always).
   */
  sha256?: string | null;
}

/** Token usage summed over a conversation (extension); each sum stops at 2**53 - 1. */
export interface IUsage {
  input_tokens: number;
  output_tokens: number;
}
