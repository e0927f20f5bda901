"""On-policy RL trainers, the ones that generate with the sampler every step: the GRPO family
(grpo/). Their objectives are pure functions in jaxrl.objectives; the offline trainers (SFT,
reward models, DPO) live in jaxrl.train."""
