"""distributed: precision across processes. Every policy's training job runs under torchrun (``launch``) on N
ranks; each rank wraps the model as its distributed modifier says (``wrap``: DDP communication hooks, FSDP2
mixed precision), trains on its slice of the global batch (``train``), counts what its collectives send
(``collectives``), and rank 0 records it; ``scaling`` estimates, from those measurements, where each compression
pays. torch.distributed does all communication; nothing here replaces it."""
