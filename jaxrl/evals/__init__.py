"""Held-out evaluation: pure metrics (metrics.py), the evaluator (evaluator.py) and
`jaxrl eval` (command.py)."""
