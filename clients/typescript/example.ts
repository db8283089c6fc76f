// How the admin app and the chat client use the declarations. `make test`
// compiles this file with `tsc --strict --noEmit`; every `@ts-expect-error`
// line must fail to compile, or the check fails.
import type {
  AgentMessageByRole,
  IAgentConversation,
  IAgentMessage,
  IConversationPage,
  IMessagePage,
  ISystemMessage,
  IToolCall,
} from "./agent-message";

// Documents read from the collections with the MongoDB driver hold `Date`s.
function lastActive(conversation: IAgentConversation): string {
  return `${conversation.name ?? "Untitled"} · ${conversation.updated_at.toISOString()}`;
}

// The API's JSON holds ISO strings: the pages default to `string` dates.
function conversationTitles(page: IConversationPage): string[] {
  return page.data.map((c) => `${c.name ?? "Untitled"} (${new Date(c.updated_at).getTime()})`);
}

function toolNames(calls: IToolCall[] | null): string {
  return (calls ?? []).map((call) => call.function.name).join(", ");
}

// `role` narrows a message to the fields its role can hold.
function describe<TDate extends Date | string>(message: AgentMessageByRole<TDate>): string {
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
function totalTokens(messages: IAgentMessage<string>[]): number {
  return messages.reduce(
    (sum, m) => sum + (m.token_usage ? m.token_usage.input_tokens + m.token_usage.output_tokens : 0),
    0,
  );
}

function transcriptLines(page: IMessagePage): string[] {
  const flat: IAgentMessage<string>[] = page.data;
  return [...page.data.map(describe), `tokens: ${totalTokens(flat)}`];
}

function pendingQuestion(conversation: IAgentConversation<string>): string | null {
  const pending = conversation.pending_hitl;
  return pending === null ? null : `${pending.action} since ${pending.created_at}`;
}

const trigger: ISystemMessage = {
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
const withCalls: ISystemMessage = { ...trigger, tool_calls: [] };

// @ts-expect-error `role` is a closed set
const unknownRole: IAgentMessage = { ...trigger, role: "bot" };

function apiDateIsNotADate(page: IMessagePage): Date | undefined {
  // @ts-expect-error the API carries dates as ISO strings
  return page.data[0]?.created_at;
}

function documentNameMayBeNull(conversation: IAgentConversation): string {
  // @ts-expect-error a conversation is unnamed until its first user text
  return conversation.name;
}

export {
  apiDateIsNotADate,
  conversationTitles,
  describe,
  documentNameMayBeNull,
  lastActive,
  pendingQuestion,
  transcriptLines,
  unknownRole,
  withCalls,
};
