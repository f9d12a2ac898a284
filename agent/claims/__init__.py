"""Claim preparation: prepare/unprepare state machine, checkpoint, CDI specs, and the sharing each claim
asks for (`sharing`, on agent.sharing); the opaque configs themselves are agent.claimconfig's."""
