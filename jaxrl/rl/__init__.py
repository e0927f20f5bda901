"""RL algorithms: advantage estimators and losses (pure functions), and their trainers."""
