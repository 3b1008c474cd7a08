"""Engine-agnostic parts: layout, keys, planner, policy, tiers, copies. Never imports vLLM."""
