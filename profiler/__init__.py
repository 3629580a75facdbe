"""m2r2-profile: where a decode step's time goes, against this machine's own limits, as a trace to open."""
