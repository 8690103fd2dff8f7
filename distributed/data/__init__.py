"""peerline.distributed.data"""
