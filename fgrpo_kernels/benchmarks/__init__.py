"""`fgrpo bench`: presets, the compared implementations, measurement, report and plots."""
