"""Expert services: the expert worker (routed-expert FFNs of MoE layers, per the placement) and
the remote ExpertExecutor that prefill/decode workers use to reach it."""
