"""The objectives, pure functions of arrays: advantage estimators (advantages.py), the policy
gradient and KL losses (losses.py) and the preference losses (preference_losses.py). They take
keyword-only arrays and return per-token or per-example values; the trainers reduce them."""
