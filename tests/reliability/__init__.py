"""Reliability: the contracts under storms, edges and faults (bounded in time)."""
