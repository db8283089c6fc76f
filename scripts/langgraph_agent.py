"""A real LangGraph tool agent for the checkpointer's tests and benchmark.

`StateGraph(MessagesState)`, a `ToolNode` and a scripted chat model, so two runs of the same
turns say the same things.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import interrupt


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"{city}: 18 degrees, light wind"


class ScriptedModel(BaseChatModel):
    """Every even question asks for the weather first, then answers with the tool's result;
    odd questions are answered at once. Ids, usage and metadata are set as a provider would."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        return ChatResult(generations=[ChatGeneration(message=self.reply(messages))])

    @staticmethod
    def reply(messages: list[BaseMessage]) -> AIMessage:
        humans = [m for m in messages if isinstance(m, HumanMessage)]
        asked = int(str(humans[-1].id).removeprefix("human-")) if humans else 0
        last = messages[-1]
        usage = {"input_tokens": 10 * len(messages), "output_tokens": 7, "total_tokens": 0}
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        metadata = {"model_name": "scripted-1", "finish_reason": "stop"}
        if isinstance(last, HumanMessage) and asked % 2 == 0:
            return AIMessage(
                content="",
                id=f"ai-{asked}-call",
                tool_calls=[
                    {"name": "weather", "args": {"city": f"City {asked}"}, "id": f"call-{asked}"}
                ],
                usage_metadata=usage,  # type: ignore[arg-type]
                response_metadata=metadata | {"finish_reason": "tool_calls"},
            )
        said = last.content if isinstance(last, ToolMessage) else "noted"
        return AIMessage(
            content=f"Answer {asked}: {said}",
            id=f"ai-{asked}-answer",
            usage_metadata=usage,  # type: ignore[arg-type]
            response_metadata=metadata,
        )


def tool_agent(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    """agent -> tools -> agent, until the model answers without a tool call."""
    model = ScriptedModel()

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        # A plain function: the same graph runs under `invoke` and `ainvoke`.
        return {"messages": [model.invoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([weather]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=checkpointer)


def approval_agent(checkpointer: BaseCheckpointSaver[Any]) -> CompiledStateGraph[Any]:
    """The tool agent that pauses (`interrupt`) for a person's decision before each tool call:
    resumed with "yes" the tool runs; with anything else the call is denied."""
    model = ScriptedModel()

    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    def approve(state: MessagesState) -> dict[str, list[BaseMessage]]:
        last = state["messages"][-1]
        assert isinstance(last, AIMessage)
        call = last.tool_calls[0]
        decision = interrupt({"tool_call_id": call["id"], "args": call["args"]})
        if decision == "yes":
            result = ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"])
        else:
            result = ToolMessage(f"denied: {decision}", tool_call_id=call["id"], status="error")
        return {"messages": [result]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("approve", approve)
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition, {"tools": "approve", END: END})
    builder.add_edge("approve", "agent")
    return builder.compile(checkpointer=checkpointer)


def question(turn: int) -> dict[str, list[BaseMessage]]:
    return {"messages": [HumanMessage(f"Question {turn}: how is the weather?", id=f"human-{turn}")]}


def comparable(messages: Sequence[BaseMessage]) -> list[tuple[str, dict[str, Any]]]:
    """Messages as comparable values, without the ids LangGraph draws at random (tool results)."""
    return [
        (type(m).__name__, m.model_dump(exclude={"id"} if isinstance(m, ToolMessage) else set()))
        for m in messages
    ]
