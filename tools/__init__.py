"""Developer tools: calibrating the analytic cost model against published measurements
(``calibration``), and the paper's baseline planners the benchmarks compare with
(``baselines``)."""
