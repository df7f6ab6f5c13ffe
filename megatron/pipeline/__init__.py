"""Pipeline parallelism: stage splitting (`stages`), point-to-point exchange (`p2p`) and the
1F1B / interleaved 1F1B schedules (`schedules`)."""
