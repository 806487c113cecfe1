"""C harnesses that run asyncmetal's native runtime without Python (see harness.py)."""
