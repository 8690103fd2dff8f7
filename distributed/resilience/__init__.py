"""peerline.distributed.resilience"""
