"""Everything that produces events, as subsystems: `policy` (the policy-server contract and its clients),
`embedded` (the embedded server), `model` (init-model), `proxy` (the capture proxy), `collect` (the
collect runner), `agents` (what users plug in) and `envs` (example environments). Every error raised
on purpose is a `collectors.errors.CollectorError`."""
