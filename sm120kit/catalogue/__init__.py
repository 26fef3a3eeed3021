"""The catalogue of known SM120 failures: the survey (data) and the launch rules over it."""
