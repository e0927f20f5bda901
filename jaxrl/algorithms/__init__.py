"""The trainers, one module or package per algorithm: sft, rm (reward models), dpo (the DPO
family; dpo_data its pair batches), grpo/ (the GRPO family, generating with the sampler every
step) and ppo/ (GRPO's roles plus a critic). Each builds on the shared skeleton in jaxrl.train
(the Run: run dir, mesh, starting policy, checkpoints, loop); their objectives are pure
functions in jaxrl.objectives."""
