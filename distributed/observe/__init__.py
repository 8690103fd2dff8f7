"""peerline.distributed.observe"""
