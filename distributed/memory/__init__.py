"""peerline.distributed.memory"""
