"""`shardplan verify`: run a plan for real with torch.distributed and compare what it measures
with what the cost model predicted. `launch` starts the ranks (no torch), `worker` is one
rank (torch, imported only there), `compare` is pure, `runspec` decides what runs."""
