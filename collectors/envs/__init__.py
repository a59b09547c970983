"""Example environments: tasks, an agent and a reward each, plugged into `trajstore collect` by import path.

- `packing`: decide what to pack from the forecast a tool returns (the demo's task: RL teaches it);
- `arithmetic`: questions a tiny model answers only through a calculator tool;
- `coding`: write one function in `solution.py`, graded by running its tests in the workdir;
- `subagent`: a main agent, a sub-agent and a compacted context, i.e. several segments per rollout.
"""
