"""Where the time or memory of one run goes: a decode step or a prefill by kernel, a start by
compile phase, a process by phase, the engine's cost per step."""
