"""`aot_report.py`'s parts: its targets (`targets`), the programs it compiles (`programs`, the RL
update's in `update`), how it reads them (`counting`) and its lines (`report`); the GPU
target-config files and the ROCm stand-ins (`rocm_stubs`) beside them."""
