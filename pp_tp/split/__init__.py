"""Stage planning: which module FQNs each pipeline stage owns and which pp rank runs it (the split)."""
