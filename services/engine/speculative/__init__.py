"""Speculative decoding: proposers draft tokens with confidences, the target model verifies
them losslessly in one forward, and a confidence scheduler picks how many to verify."""
