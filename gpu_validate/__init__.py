"""CuPy harness: real paged vs contiguous decode attention, timings, calibration fit."""
