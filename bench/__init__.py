"""gpumeter's benchmarks: ``python -m bench.run [--only NAME] [--quick]`` (``make bench``).

Every benchmark measures gpumeter's own code against a baseline *in the same run*, alternating the two, so that the
ratio holds on a busy machine even where the absolute figures do not. Each one writes
``bench/results/<name>.json`` (the machine, the figures and each target with whether it was met) and
``bench/run.py`` regenerates the table in ``docs/performance.md`` from every result file present.

Modules: ``attribution`` (decode + engine, GPU-samples/s), ``codec`` (Avro vs JSON per record type),
``ledger`` (bulk vs per-row inserts, SQLite and PostgreSQL), ``collector`` (CPU per tick on the simulated NVML),
``stream`` (the whole pipeline through a real broker with the services as subprocesses). ``workload`` builds the
synthetic fleet they share; ``common`` holds timing, machine facts and result files.
"""
