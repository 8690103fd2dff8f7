"""peerline.bench"""
