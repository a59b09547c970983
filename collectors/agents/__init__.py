"""The agent side users plug in: the agent and reward contract, tools from typed functions, the tool agent.

An agent is `async def agent(task, ctx: AgentContext)`; a reward is
`reward(task, result, rollout: RolloutInfo)`; tools are plain typed Python functions. Each
is plugged into `trajstore collect` by import path (`module:function`, see `load_object`).
"""

from collectors.agents.context import Agent, AgentContext, RolloutInfo, load_object, shared_http_client
from collectors.agents.tool_agent import ToolAgentResult, initial_messages, tool_agent
from collectors.agents.tools import Tool, ToolSchemaError, call_tool, load_tools, tool_schema, tools_by_name

__all__ = [
    "Agent", "AgentContext", "RolloutInfo", "Tool", "ToolAgentResult", "ToolSchemaError", "call_tool",
    "initial_messages", "load_object", "load_tools", "shared_http_client", "tool_agent", "tool_schema",
    "tools_by_name",
]
