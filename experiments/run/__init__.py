"""`servetwin run`: one experiment on its backends, its report, figures and run folder."""
