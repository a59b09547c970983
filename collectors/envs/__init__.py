"""Example environments: tasks, an agent and a reward each, plugged into `trajstore collect` by import path.

- `packing`: decide what to pack from the forecast a tool returns (the demo's task: RL teaches it);
- `arithmetic`: questions a tiny model answers only through a calculator tool;
- `coding`: write one function in `solution.py`, graded by running its tests in the workdir;
- `subagent`: a main agent, a sub-agent and a compacted context, i.e. several segments per rollout.

Adapters to environment packages others share (the `envs` extra):
- `reasoning_gym`: reasoning-gym's generators as task files, scored by its own `score_answer`;
- `text_gym`: any gymnasium-style environment whose observations and actions are text;
- `math_verify`: math-verify as a reward (`--reward math_verify`);
- `openenv`: an OpenEnv server's session (reset/step/state) as a text environment for `text_gym`;
- `verifiers`: a verifiers environment's episode per rollout, run in `.venv-envs` through the capture proxy
  (`venv` finds that virtualenv, `make envs` builds it).
"""
