package cluster

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/redis/rueidis"
)

// Streams by master. A Get's records are read by streamed GETs, at most
// Config.Streams at once store-wide. Handed out in the keys' order, those
// streams pile up on whichever master is slowest at the moment: its GETs
// take longest, so it holds the most streams while the others run dry,
// and a master with more replies outstanding spends more CPU on each
// (on the H200 with 48 streams over 3 masters and 2 MiB records, one
// master 1.0 core busy while the others were 0.5, with the same share
// of the calls each). redis-benchmark --cluster has no such trouble:
// each of its connections sends only keys of one node. So when the slot
// map is known a Get sorts its keys by master, and each master's keys
// are read by at most Streams/masters streams, rounded up (store-wide, a
// semaphore a master), the master's keys one after another: every master
// keeps its share of the streams busy for as long as it has keys to
// serve. The price: a Get whose keys are mostly on one master reads them
// with that master's share, not all of Streams (the engine's keys are
// block hashes, spread over the slots evenly).
//
// The map (CLUSTER SLOTS, read at connect and with the generation every
// GenerationRefresh) schedules, it does not route: the client sends each
// GET to the slot's owner as it knows it and follows MOVED and ASK, so a
// stale map costs balance, never a wrong record (with a negative
// GenerationRefresh the map read at connect is never re-read). Without a
// map (the command refused, or a reply naming no master) a Get hands its
// keys to the store-wide streams in order, as before; keys of a slot the
// map names no master for go the same way.

// slotMap is which master served each hash slot when CLUSTER SLOTS was
// read, and a semaphore for each master.
type slotMap struct {
	owner [16384]uint8 // index into sems and addrs; noMaster: no master known
	sems  []chan struct{}
	addrs []string // each master's host:port ("" where the reply did not say)
}

const noMaster = 0xff

// keySlot is Redis Cluster's hash slot of a key: CRC-16/XMODEM, modulo
// 16384, of the key or, when it has a hash tag (the bytes between its
// first '{' and the first '}' after it, not none), of the tag. The
// store's keys have one only if Prefix or Namespace does.
func keySlot(key string) uint16 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % 16384
}

// masterSems keeps each master's semaphore across refreshes, by node
// (a stream holds the one it took until it ends).
type masterSems struct {
	mu   sync.Mutex
	sems map[string]chan struct{}
}

// refreshSlots reads CLUSTER SLOTS through client and installs the map; on
// a failure the map is left as it was.
func (s *Store) refreshSlots(ctx context.Context, client rueidis.Client) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	ranges, err := client.Do(ctx, client.B().ClusterSlots().Build()).ToArray()
	if err != nil {
		return err
	}
	m, err := s.parseSlots(ranges)
	if err != nil {
		return err
	}
	s.slots.Store(m)
	return nil
}

// slotRange is one entry of CLUSTER SLOTS: slots first to last (both
// included) served by the master node (its node ID where the reply gives
// one, else its address: what tells masters apart), at addr (host:port,
// "" where the reply does not say).
type slotRange struct {
	first, last int64
	node, addr  string
}

// parseSlots makes a slotMap of CLUSTER SLOTS' reply: ranges of [first
// slot, last slot, [master host, port, ...], replicas...].
func (s *Store) parseSlots(ranges []rueidis.RedisMessage) (*slotMap, error) {
	rs := make([]slotRange, 0, len(ranges))
	for _, r := range ranges {
		f, err := r.ToArray()
		if err != nil || len(f) < 3 {
			return nil, fmt.Errorf("cluster: CLUSTER SLOTS entry %v: not an array of 3 or more", r)
		}
		first, err1 := f[0].AsInt64()
		last, err2 := f[1].AsInt64()
		node, err3 := f[2].ToArray()
		if err1 != nil || err2 != nil || err3 != nil || len(node) < 2 {
			return nil, fmt.Errorf("cluster: CLUSTER SLOTS entry %v: slots or node unreadable", r)
		}
		// The node ID (Redis 4 and later) tells masters apart even where
		// their endpoints do not (an unknown endpoint is NULL, a hidden
		// one ""); else host:port.
		var id, addr string
		if len(node) > 2 {
			id, _ = node[2].ToString()
		}
		host, err1 := node[0].ToString()
		port, err2 := node[1].AsInt64()
		if err1 == nil && err2 == nil && host != "" {
			addr = net.JoinHostPort(host, strconv.FormatInt(port, 10))
		}
		if id == "" {
			id = addr
		}
		if id == "" {
			return nil, fmt.Errorf("cluster: CLUSTER SLOTS entry %v: neither node ID nor address", r)
		}
		rs = append(rs, slotRange{first, last, id, addr})
	}
	return s.buildSlotMap(rs)
}

// buildSlotMap makes a slotMap of ranges (a later range naming a slot
// again wins) and installs the masters' semaphores: Streams shared out
// among them (rounded up), a master's kept while it stays one with the
// same share, dropped once it is not. A range outside 0–16383 or with
// last < first, more than 255 masters or none is an error and changes
// nothing.
func (s *Store) buildSlotMap(ranges []slotRange) (*slotMap, error) {
	m := &slotMap{}
	for i := range m.owner {
		m.owner[i] = noMaster
	}
	index := map[string]int{}
	var nodes, addrs []string
	for _, r := range ranges {
		if r.first < 0 || r.last < r.first || r.last >= int64(len(m.owner)) {
			return nil, fmt.Errorf("cluster: CLUSTER SLOTS range %d-%d of %s: outside 0-%d", r.first, r.last, r.node, len(m.owner)-1)
		}
		k, ok := index[r.node]
		if !ok {
			if len(nodes) == noMaster {
				return nil, fmt.Errorf("cluster: CLUSTER SLOTS names more than %d masters", noMaster)
			}
			k = len(nodes)
			index[r.node] = k
			nodes = append(nodes, r.node)
			addrs = append(addrs, r.addr)
		}
		for slot := r.first; slot <= r.last; slot++ {
			m.owner[slot] = uint8(k)
		}
	}
	if len(nodes) == 0 {
		return nil, fmt.Errorf("cluster: CLUSTER SLOTS names no master")
	}
	per := max(1, (s.cfg.Streams+len(nodes)-1)/len(nodes))
	s.masterSems.mu.Lock()
	defer s.masterSems.mu.Unlock()
	sems := make(map[string]chan struct{}, len(nodes))
	for _, n := range nodes {
		sem := s.masterSems.sems[n]
		if sem == nil || cap(sem) != per {
			sem = make(chan struct{}, per)
		}
		sems[n] = sem
		m.sems = append(m.sems, sem)
	}
	m.addrs = addrs
	s.masterSems.sems = sems
	return m, nil
}

// getByMaster is get's streamed path: with a slot map m, keys sorted by
// master, each master's read by at most its semaphore's streams, every one
// also holding one of the store's; keys of a slot without a known master,
// and every key when m is nil, take only the store's, in order.
func (s *Store) getByMaster(ctx context.Context, client rueidis.Client, m *slotMap, gen uint64, keys [][16]byte, dsts [][]byte, direct bool, ok []bool) {
	var sems []chan struct{}
	if m != nil {
		sems = m.sems
	}
	rkeys := make([]string, len(keys))
	groups := make([][]int, len(sems)+1)
	for i, k := range keys {
		rkeys[i] = s.key(gen, k)
		g := len(sems)
		if m != nil {
			if o := m.owner[keySlot(rkeys[i])]; o != noMaster {
				g = int(o)
			}
		}
		groups[g] = append(groups[g], i)
	}
	var wg sync.WaitGroup
	for g, idx := range groups {
		if len(idx) == 0 {
			continue
		}
		var sem chan struct{}
		workers := min(len(idx), cap(s.streams))
		if g < len(sems) {
			sem = sems[g]
			workers = min(workers, cap(sem))
		}
		var next atomic.Int64
		for range workers {
			wg.Add(1)
			s.goLabelled(func() {
				defer wg.Done()
				for {
					j := int(next.Add(1)) - 1
					if j >= len(idx) {
						return
					}
					i := idx[j]
					if !s.acquireStream(ctx, sem) {
						s.countMiss(ctx.Err())
						continue
					}
					ok[i] = s.getStreamed(ctx, client, rkeys[i], keys[i], dsts[i], direct)
					<-s.streams
					if sem != nil {
						<-sem
					}
				}
			})
		}
	}
	wg.Wait()
}

// acquireStream takes a place in sem (when not nil) and then one of the
// store's streams, unless ctx ends first (then it holds neither).
func (s *Store) acquireStream(ctx context.Context, sem chan struct{}) bool {
	if sem != nil {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return false
		}
	}
	select {
	case s.streams <- struct{}{}:
		return true
	case <-ctx.Done():
		if sem != nil {
			<-sem
		}
		return false
	}
}
