"""peerline.distributed.p2p"""
