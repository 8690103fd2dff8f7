"""peerline.distributed.pipeline"""
