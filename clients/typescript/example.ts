// How the admin app and the chat client use the declarations: the collections
// read with the official MongoDB Node.js driver, the admin API with `fetch`.
// `make test` compiles this file with `tsc --strict` (every `@ts-expect-error`
// line must fail to compile, or the check fails) and runs it on the example
// conversation through smoke.ts (tests/test_node_client.py).
import type { Db } from "mongodb";

import type {
  AgentMessageByRole,
  AgentMessageDocument,
  IAgentConversation,
  IAgentConversationDocument,
  IAgentMessage,
  IApiErrorBody,
  IClaimed,
  IConversationExport,
  IConversationPage,
  IDeleted,
  IHealth,
  IHitlResolved,
  ILoggedTurn,
  IMessagePage,
  IPendingCall,
  IPendingHitlState,
  IReadiness,
  ISearchResults,
  ISystemMessage,
  IToolCall,
  ITranscript,
  IUserExport,
} from "./agent-message";

// -- the collections, through the driver: times are `Date`s -----------------------------

export async function storedConversation(
  db: Db,
  conversationId: string,
): Promise<IAgentConversationDocument | null> {
  return db
    .collection<IAgentConversationDocument>("agent_conversations")
    .findOne({ _id: conversationId });
}

/** Every message of a conversation by `seq`, read in batches of `batchSize`. */
export async function storedTranscript(
  db: Db,
  conversationId: string,
  batchSize = 5,
): Promise<AgentMessageDocument[]> {
  return db
    .collection<AgentMessageDocument>("agent_messages")
    .find({ conversation_id: conversationId })
    .sort({ seq: 1 })
    .batchSize(batchSize)
    .toArray();
}

export async function messagesByRole(
  db: Db,
  conversationId: string,
): Promise<Record<string, number>> {
  const counts = await db
    .collection<AgentMessageDocument>("agent_messages")
    .aggregate<{ _id: string; n: number }>([
      { $match: { conversation_id: conversationId } },
      { $group: { _id: "$role", n: { $sum: 1 } } },
    ])
    .toArray();
  return Object.fromEntries(counts.map((c) => [c._id, c.n]));
}

// Stored messages always hold their id, conversation, `seq` and turn.
export function messagesById(messages: AgentMessageDocument[]): Map<string, AgentMessageDocument> {
  const byId = new Map<string, AgentMessageDocument>();
  for (const message of messages) byId.set(message._id, message);
  return byId;
}

export function positions(messages: AgentMessageDocument[]): number[] {
  return messages.map((m) => m.seq);
}

export function lastActive(conversation: IAgentConversation<Date>): string {
  return `${conversation.name ?? "Untitled"} · ${conversation.updated_at.toISOString()}`;
}

// -- the admin API, through fetch: times are strings ------------------------------------

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly body: IApiErrorBody,
  ) {
    super(`${status} ${body.error.code}: ${body.error.message}`);
  }
}

export interface TurnToLog {
  messages: Record<string, unknown>[];
  turn_id?: string;
  user_id?: string;
  name?: string;
}

/** Every route of the admin API, each answering with its declared type. */
export class AdminApi {
  constructor(
    readonly base: string,
    private readonly token: string,
  ) {}

  private async call<T>(method: string, path: string, body?: unknown): Promise<T> {
    const response = await this.send(method, path, body);
    return (await response.json()) as T;
  }

  async send(method: string, path: string, body?: unknown): Promise<Response> {
    const headers: Record<string, string> = { Authorization: `Bearer ${this.token}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(`${this.base}${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) throw new ApiError(response.status, (await response.json()) as IApiErrorBody);
    return response;
  }

  health(): Promise<IHealth> {
    return this.call("GET", "/health");
  }
  ready(): Promise<IReadiness> {
    return this.call("GET", "/ready");
  }
  conversations(userId: string, limit = 20, cursor?: string): Promise<IConversationPage> {
    const query = new URLSearchParams({ limit: String(limit), ...(cursor ? { cursor } : {}) });
    return this.call("GET", `/v1/users/${userId}/conversations?${query}`);
  }
  conversation(id: string): Promise<IAgentConversation<string>> {
    return this.call("GET", `/v1/conversations/${id}`);
  }
  rename(id: string, name: string): Promise<IAgentConversation<string>> {
    return this.call("PATCH", `/v1/conversations/${id}`, { name });
  }
  delete(id: string): Promise<IDeleted> {
    return this.call("DELETE", `/v1/conversations/${id}`);
  }
  transcript(id: string): Promise<ITranscript> {
    return this.call("GET", `/v1/conversations/${id}/transcript`);
  }
  messages(id: string, limit: number, after?: string): Promise<IMessagePage> {
    const query = new URLSearchParams({ limit: String(limit), ...(after ? { after } : {}) });
    return this.call("GET", `/v1/conversations/${id}/messages?${query}`);
  }
  logTurn(id: string, turn: TurnToLog): Promise<ILoggedTurn> {
    return this.call("POST", `/v1/conversations/${id}/turns`, turn);
  }
  pendingHitl(id: string): Promise<IPendingHitlState> {
    return this.call("GET", `/v1/conversations/${id}/hitl`);
  }
  /**
   * `calls`: the calls the answer concerns, as read from `pending_calls`. Each is named by
   * its id and the message that made it, so an answer read before a later prompt asked
   * under the same request id about a call of the same id does not answer that prompt.
   */
  resolveHitl(
    id: string,
    requestId: string,
    calls?: Pick<IPendingCall<string>, "tool_call_id" | "message_id">[],
  ): Promise<IHitlResolved> {
    const named = calls?.map(({ tool_call_id, message_id }) => ({ tool_call_id, message_id }));
    const body = { request_id: requestId, ...(named ? { calls: named } : {}) };
    return this.call("POST", `/v1/conversations/${id}/hitl/resolve`, body);
  }
  search(q: string, userId: string): Promise<ISearchResults> {
    return this.call("GET", `/v1/search?${new URLSearchParams({ q, user_id: userId })}`);
  }
  exportUser(userId: string): Promise<IUserExport> {
    return this.call("GET", `/v1/users/${userId}/export?format=json`);
  }
  async exportUserLines(userId: string): Promise<IConversationExport[]> {
    const response = await this.send("GET", `/v1/users/${userId}/export?format=jsonl`);
    const lines = (await response.text()).split("\n").filter((line) => line !== "");
    return lines.map((line) => JSON.parse(line) as IConversationExport);
  }
  eraseUser(userId: string): Promise<IDeleted> {
    return this.call("DELETE", `/v1/users/${userId}`);
  }
  claim(fromUserId: string, toUserId: string): Promise<IClaimed> {
    return this.call("POST", "/v1/claims", { from_user_id: fromUserId, to_user_id: toUserId });
  }
}

export function conversationTitles(page: IConversationPage): string[] {
  return page.data.map((c) => `${c.name ?? "Untitled"} (${new Date(c.updated_at).getTime()})`);
}

function toolNames(calls: IToolCall[] | null): string {
  return (calls ?? []).map((call) => call.function.name).join(", ");
}

// `role` narrows a message to the fields its role can hold.
export function describe<TDate extends Date | string>(message: AgentMessageByRole<TDate>): string {
  switch (message.role) {
    case "system":
      return `system: ${message.content ?? ""}`;
    case "user":
      return message.upload !== null
        ? `uploaded ${message.upload.filename} (${message.upload.size} bytes)`
        : `user: ${message.content ?? ""}`;
    case "assistant":
      if (message.hitl_action !== null) return `asks: ${message.hitl_action.action}`;
      if (message.tool_calls !== null) return `calls ${toolNames(message.tool_calls)}`;
      return `assistant: ${message.content ?? message.error?.message ?? ""}`;
    case "tool":
      return `result of ${message.tool_call_id ?? "?"}: ${message.content ?? ""}`;
  }
}

// The flat interface reads any message without narrowing; every role fits it.
export function totalTokens<TDate extends Date | string>(messages: IAgentMessage<TDate>[]): number {
  return messages.reduce(
    (sum, m) => sum + (m.token_usage ? m.token_usage.input_tokens + m.token_usage.output_tokens : 0),
    0,
  );
}

export function transcriptLines(transcript: ITranscript): string[] {
  return [...transcript.data.map(describe), `tokens: ${totalTokens(transcript.data)}`];
}

export function pendingQuestion(state: IPendingHitlState): string | null {
  const pending = state.pending;
  return pending === null ? null : `${pending.action} since ${pending.created_at}`;
}

// -- what the declarations refuse -------------------------------------------------------

const trigger: ISystemMessage<Date> = {
  _id: "msg-1",
  conversation_id: "conv-1",
  role: "system",
  content: "Daily summary",
  tool_calls: null,
  tool_call_id: null,
  hitl_action: null,
  error: null,
  upload: null,
  created_at: new Date("2026-01-31T09:30:00.123Z"),
  token_usage: null,
  latency_ms: null,
  seq: 0,
  user_id: "user-7",
  turn_id: "turn-1",
  search_text: "Daily summary",
  truncated: null,
  native: null,
};

// @ts-expect-error a system message never carries tool calls
export const withCalls: ISystemMessage<Date> = { ...trigger, tool_calls: [] };

// @ts-expect-error `role` is a closed set
export const unknownRole: IAgentMessage<Date> = { ...trigger, role: "bot" };

// @ts-expect-error a stored message always has its `seq`
export const withoutSeq: ISystemMessage<Date> = { ...trigger, seq: null };

// @ts-expect-error a time is a `Date` from the driver or a `string` from the API: say which
export type Unparameterized = IAgentConversation;

export function apiDateIsNotADate(transcript: ITranscript): Date | undefined {
  // @ts-expect-error the API carries times as strings
  return transcript.data[0]?.created_at;
}

export function documentNameMayBeNull(conversation: IAgentConversationDocument): string {
  // @ts-expect-error a conversation is unnamed until its first user text
  return conversation.name;
}
