"""One seam, both sides: the example payloads in ``schemas/examples`` are what each producer's real code makes and
what each consumer's real code reads (collector → NodeSample → attributor → GpuShare → billing → CostRecord)."""
