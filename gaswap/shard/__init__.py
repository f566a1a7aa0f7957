"""One rank's step under FSDP2 (torch side): capture helpers, FSDPMemTracker under the fake process group, a gloo
runner. The torch-free rank model is `gaswap.plan.sharding`."""
