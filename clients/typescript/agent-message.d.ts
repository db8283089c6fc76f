// Declarations of the documents in `agent_messages` and `agent_conversations`
// and of the admin API's JSON, derived from the pydantic models in agent_store/core/_models.py.
// Do not edit: run `make types`; a test fails when this file is stale.
//
// Every key is present in every document and every API object; a missing
// value is `null`, never `undefined`.

/**
 * How a date reaches the reader.
 *
 * MongoDB stores dates as BSON dates, which the Node.js driver returns as
 * `Date`; the admin API's JSON carries them as ISO 8601 strings in UTC
 * (`"2026-01-31T09:30:00.123000Z"`, which `new Date(...)` parses). Every type
 * holding a date takes it as the parameter `TDate`: it defaults to `Date`
 * for documents read from the collections and to `string` for API pages, so
 * write `IAgentConversation<string>` for a conversation from the API.
 */
export type DateLike = Date | string;

/** Who speaks a message, as in the OpenAI chat format. */
export type MessageRole = "system" | "user" | "assistant" | "tool";

/**
 * Any message, as one flat interface: every role has every field.
 *
 * Narrow to the role's own interface with `AgentMessageByRole`.
 */
export interface IAgentMessage<TDate extends DateLike = Date> {
  /** Stable message id (extension). Assigned by the logger when not given. */
  _id: string | null;
  /** The conversation this message belongs to. Set by the logger. */
  conversation_id: string | null;
  role: MessageRole;
  content: string | null;
  tool_calls: IToolCall[] | null;
  tool_call_id: string | null;
  hitl_action: IHitlAction | null;
  error: IMessageError | null;
  upload: IFileUpload | null;
  created_at: TDate;
  token_usage: ITokenUsage | null;
  latency_ms: number | null;
  /** Position in the conversation (extension). Assigned by the logger. */
  seq: number | null;
  /** The conversation's owner, denormalized (extension). Set by the logger. */
  user_id: string | null;
  /** The turn that logged this message (extension). Set by the logger. */
  turn_id: string | null;
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
export type AgentMessageByRole<TDate extends DateLike = Date> =
  | ISystemMessage<TDate>
  | IUserMessage<TDate>
  | IAssistantMessage<TDate>
  | IToolMessage<TDate>;

/** A system prompt or a system-triggered turn. */
export interface ISystemMessage<TDate extends DateLike = Date> extends IAgentMessage<TDate> {
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
export interface IUserMessage<TDate extends DateLike = Date> extends IAgentMessage<TDate> {
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
export interface IAssistantMessage<TDate extends DateLike = Date> extends IAgentMessage<TDate> {
  role: "assistant";
  /** Always `null` when `role` is `assistant`. */
  tool_call_id: null;
  /** Always `null` when `role` is `assistant`. */
  upload: null;
}

/** The result of one tool call, answering it by `tool_call_id`. */
export interface IToolMessage<TDate extends DateLike = Date> extends IAgentMessage<TDate> {
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
export interface IAgentConversation<TDate extends DateLike = Date> {
  /** Equal to `conversation_id`. */
  _id: string;
  conversation_id: string;
  /** The owner; `null` for a conversation only services write to. */
  user_id: string | null;
  name: string | null;
  /** Who chose `name` (extension): automatic names yield to a runtime's, both to a person's. */
  name_source: "auto" | "runtime" | "set" | null;
  created_at: TDate;
  /** The time of the last message. */
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
}

/** A page of a conversation's messages. */
export interface IMessagePage<TDate extends DateLike = string> {
  data: AgentMessageByRole<TDate>[];
  has_more: boolean;
  first_id: string | null;
  last_id: string | null;
  /**
   * The `seq` of a message reserved by a turn still being written: an ascending page stops
   * before it, so a reader following the conversation asks again with the same `after`.
   */
  pending_seq: number | null;
}

/** A page of a user's conversations, newest first. */
export interface IConversationPage<TDate extends DateLike = string> {
  data: IAgentConversation<TDate>[];
  has_more: boolean;
  first_id: string | null;
  last_id: string | null;
  /** Pass as `cursor` to read the next page; null on the last page. */
  next_cursor: string | null;
}

/** A file the user uploaded with a message. */
export interface IFileUpload {
  filename: string;
  file_type: string;
  size: number;
  parsed_text: string | null;
}

/** Where a forked conversation came from (extension). */
export interface IForkOrigin {
  conversation_id: string;
  /** The last `seq` of the original the fork copied. */
  seq: number;
}

/** The function an assistant asks to call. */
export interface IFunctionCall {
  /** The tool's name. */
  name: string;
  /**
   * The arguments as a JSON string; a dict is accepted and serialized.
   *
   * As in the OpenAI format, a string the model produced is kept as it is,
   * even when it is not valid JSON, so that a turn is never lost over it.
   */
  arguments: string;
}

/** A human-in-the-loop prompt the assistant raised. */
export interface IHitlAction {
  action: string;
  /** Plain JSON values, nested at most `MAX_PARAMS_DEPTH` levels. */
  params: Record<string, unknown>;
  request_id: string;
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
  /** Whose form: `openai-agents` (an Agents SDK item) or `langchain` (a LangChain message). */
  format: string;
  /** Top-level keys whose values the rebuilt form lacks or holds otherwise; plain JSON. */
  set: Record<string, unknown>;
  /** Keys of the rebuilt form that the runtime's form does not have. */
  unset: string[];
}

/**
 * A tool call left without an answer, awaiting one from a later turn (extension).
 *
 * Its turn ended with the call open: it awaits a person's approval or
 * confirmation, or a result computed elsewhere. The `tool` message a later
 * turn logs for it is its answer, and it is then no longer pending.
 */
export interface IPendingCall<TDate extends DateLike = Date> {
  tool_call_id: string;
  tool_name: string;
  /** The assistant message that made the call. */
  message_id: string;
  /** The HITL prompt that holds the call back: the first one its turn raised after it. */
  request_id: string | null;
  /** When the call was made. */
  created_at: TDate;
}

/** The unresolved HITL prompt of a conversation (extension). */
export interface IPendingHitl<TDate extends DateLike = Date> {
  request_id: string;
  action: string;
  params: Record<string, unknown>;
  /** The assistant's text that asked the question. */
  prompt: string | null;
  /** The assistant message that raised it. */
  message_id: string;
  created_at: TDate;
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
}

/** Token usage summed over a conversation (extension); each sum stops at 2**53 - 1. */
export interface IUsage {
  input_tokens: number;
  output_tokens: number;
}
