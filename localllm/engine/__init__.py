"""The engine: requests, block manager, scheduler, model runner, sampler, front ends."""
