"""ThunderServe's deployment planner (Jiang et al., §3): groups, phases, parallel configurations, orchestration.

`deploy.thunderserve_placement` is `plan_placement(method="thunderserve")`; `reschedule.reschedule` is §3.4's
lightweight rescheduling. One concept per module: settings, gpus (the cluster as GPUs and links), deployment
(the upper level's solution and its first value), neighbours (the four moves), stage_order (the pipeline
path), parallel (Appendix B per group), slo (the attainment estimate), orchestration (the transportation LP),
tabu (Algorithm 1).
"""
