"""Speculative-decoding runtime: topology, state management, acceptance, drafting, the loop."""
