"""Claim preparation: prepare/unprepare state machine, checkpoint, CDI specs, opaque configs."""
