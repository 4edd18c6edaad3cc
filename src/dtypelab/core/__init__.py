"""The core every capability builds on: errors, the Task, hardware facts, precision policies and plans,
the one training/evaluation loop, measurement primitives and the result records."""
