"""`servetwin capacity`: the highest arrival rate that meets the SLOs."""
