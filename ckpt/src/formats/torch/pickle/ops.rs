//! The opcodes, by group: the stack and its marks, scalars, text, containers, the memo, and
//! objects (globals, `REDUCE`, `BUILD`, persistent ids). Each group is one method the machine's
//! loop dispatches to; what applying a global means is in `calls.rs`.

use super::*;

impl Machine<'_> {
    /// One opcode of the stack and its marks: `PROTO`, `FRAME`, `MARK`, `POP`, `POP_MARK`, `DUP`.
    pub(super) fn frame_op(&mut self, op: u8) -> R<()> {
        match op {
            0x80 => {
                let proto = self.u8()?;
                if proto > 5 {
                    return self.bad(format!("unsupported pickle protocol {proto}"));
                }
            }
            0x95 => {
                self.take(8)?;
            }
            b'(' => {
                if self.marks.len() >= self.limits.max_depth as usize {
                    return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
                }
                self.marks.push(self.stack.len());
            }
            b'0' => {
                self.pop()?;
            }
            b'1' => {
                self.pop_mark()?;
            }
            b'2' => {
                let v = self.top()?;
                self.push(v)?;
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of numbers and constants: `NONE`, the booleans, the integers in text and binary, `BINFLOAT`.
    pub(super) fn scalar_op(&mut self, op: u8) -> R<()> {
        match op {
            b'N' => self.push(V::None)?,
            0x88 => self.push(V::Bool(true))?,
            0x89 => self.push(V::Bool(false))?,
            b'J' => {
                let v = i32::from_le_bytes(self.arr()?);
                self.push(V::Int(v.into()))?
            }
            b'K' => {
                let v = self.u8()?;
                self.push(V::Int(v.into()))?
            }
            b'M' => {
                let v = u16::from_le_bytes(self.arr()?);
                self.push(V::Int(v.into()))?
            }
            0x8a => {
                let n = usize::from(self.u8()?);
                self.long(n)?
            }
            0x8b => {
                let n = self.len_u32()?;
                self.long(n)?
            }
            b'G' => {
                let v = f64::from_be_bytes(self.arr()?);
                self.push(V::Float(v))?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of strings and bytes, in every width.
    pub(super) fn text_op(&mut self, op: u8) -> R<()> {
        match op {
            b'X' => {
                let n = self.len_u32()?;
                let v = self.utf8(n)?;
                self.push(v)?
            }
            0x8c => {
                let n = usize::from(self.u8()?);
                let v = self.utf8(n)?;
                self.push(v)?
            }
            0x8d => {
                let n = self.len_u64()?;
                let v = self.utf8(n)?;
                self.push(v)?
            }
            // py2 byte strings: torch reads them as latin-1 text.
            b'U' | b'T' => {
                let n = if op == b'U' { usize::from(self.u8()?) } else { self.len_u32()? };
                let at = self.pos;
                let wide = self.take(n)?.iter().filter(|&&b| b >= 0x80).count();
                self.afford(alloc_bytes(n + wide))?;
                let mut s = String::with_capacity(n + wide);
                s.extend(self.data.get(at..at + n).unwrap_or_default().iter().map(|&b| char::from(b)));
                let v = self.alloc(Obj::Str(s))?;
                self.push(v)?
            }
            b'C' | b'B' | 0x8e | 0x96 => {
                let n = match op {
                    b'C' => usize::from(self.u8()?),
                    b'B' => self.len_u32()?,
                    _ => self.len_u64()?,
                };
                let b = self.taken(n)?.to_vec();
                let v = self.alloc(Obj::Bytes(b))?;
                self.push(v)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of tuples, lists, dicts and sets, and the opcodes that fill them.
    pub(super) fn container_op(&mut self, op: u8) -> R<()> {
        match op {
            b')' => {
                let v = self.alloc(Obj::Tuple(Vec::new()))?;
                self.push(v)?
            }
            b't' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?
            }
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop()?);
                }
                items.reverse();
                let v = self.alloc(Obj::Tuple(items))?;
                self.push(v)?
            }
            b']' => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?
            }
            b'l' => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items))?;
                self.push(v)?
            }
            // Sets become lists: order is all a reader can observe.
            0x8f => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?
            }
            0x91 => {
                let items = self.pop_mark()?;
                let v = self.alloc(Obj::List(items))?;
                self.push(v)?
            }
            b'a' | b'e' | 0x90 => {
                let (start, target) = self.added((op == b'a').then_some(1))?;
                self.extend_list(target, start)?
            }
            b'}' => {
                let v = self.alloc(Obj::Dict(Vec::new()))?;
                self.push(v)?
            }
            b'd' => {
                let Some(m) = self.marks.pop() else {
                    return self.bad("no mark on the stack");
                };
                let m = m.min(self.stack.len());
                if !(self.stack.len() - m).is_multiple_of(2) {
                    return self.bad("odd number of dict items");
                }
                self.afford(vec_bytes::<(V, V)>((self.stack.len() - m) / 2))?;
                let pairs = pairs(self.stack.drain(m..));
                let v = self.alloc(Obj::Dict(pairs))?;
                self.push(v)?
            }
            b's' | b'u' => {
                let (start, target) = self.added((op == b's').then_some(2))?;
                if !(self.stack.len() - start).is_multiple_of(2) {
                    return self.bad("odd number of dict items");
                }
                self.extend_dict(target, start)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of the memo: `BINPUT`, `LONG_BINPUT`, `MEMOIZE`, `BINGET`, `LONG_BINGET`.
    pub(super) fn memo_op(&mut self, op: u8) -> R<()> {
        match op {
            b'q' => {
                let i = self.u8()?;
                self.memo_put(i.into())?
            }
            b'r' => {
                let i = u32::from_le_bytes(self.arr()?);
                self.memo_put(i)?
            }
            0x94 => {
                let i = u32::try_from(self.dense.len() + self.memo.len()).unwrap_or(u32::MAX);
                self.memo_put(i)?
            }
            b'h' => {
                let i = self.u8()?;
                self.memo_get(i.into())?
            }
            b'j' => {
                let i = u32::from_le_bytes(self.arr()?);
                self.memo_get(i)?
            }
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// One opcode of objects: globals (`GLOBAL`, `STACK_GLOBAL`), persistent ids, `REDUCE`, `NEWOBJ` and `BUILD`.
    pub(super) fn object_op(&mut self, op: u8) -> R<()> {
        match op {
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.global(&module, &name)?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                let (Some(module), Some(name)) = (self.str_of(module), self.str_of(name)) else {
                    return self.bad("STACK_GLOBAL needs two strings");
                };
                let (module, name) = (module.to_string(), name.to_string());
                self.global(&module, &name)?
            }
            b'Q' => {
                let pid = self.pop()?;
                let v = self.persistent(pid)?;
                self.push(v)?
            }
            b'R' => {
                let args = self.pop()?;
                let func = self.pop()?;
                let v = self.call(func, args)?;
                self.push(v)?
            }
            0x81 => self.new_obj()?,
            b'b' => self.build()?,
            other => return self.bad(format!("unsupported opcode 0x{other:02x}")),
        }
        Ok(())
    }

    /// `NEWOBJ`: `cls.__new__(cls, *args)`, for the few classes that pickle this way.
    fn new_obj(&mut self) -> R<()> {
        let args = self.pop()?;
        let cls = self.pop()?;
        match self.global_of(cls) {
            Some(Global::OrderedDict) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                let v = self.alloc(Obj::Dict(Vec::new()))?;
                self.push(v)?
            }
            Some(Global::Counter) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                let v = self.alloc(Obj::Dict(Vec::new()))?;
                self.push(v)?
            }
            Some(Global::Set) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                let v = self.alloc(Obj::List(Vec::new()))?;
                self.push(v)?
            }
            // torch applies `Parameter(*args)`: the data tensor, requires_grad aside.
            Some(Global::ParameterClass) => match self.items_of(args) {
                Some(&[t, ..]) => {
                    let v = self.expect_tensor(t)?;
                    self.push(v)?
                }
                _ => return self.bad("NEWOBJ of `Parameter` needs a tensor"),
            },
            Some(Global::Unreadable(global, what)) => return self.unreadable(global, what),
            Some(Global::Class(class)) => {
                self.afford(vec_bytes::<V>(self.items_of(args).map_or(0, <[V]>::len)))?;
                let Some(args) = self.items_of(args).map(<[V]>::to_vec) else {
                    return self.bad("NEWOBJ arguments must be a tuple");
                };
                let v = self.instance(class, args)?;
                self.push(v)?
            }
            Some(Global::Script(class)) if self.items_of(args).is_some_and(<[V]>::is_empty) => {
                let v = self.alloc(Obj::Script { class, state: None })?;
                self.push(v)?
            }
            _ => return self.bad(format!("NEWOBJ of {} is not allowed", self.describe(cls))),
        }
        Ok(())
    }

    /// `BUILD`: sets the state of the object on top of the stack.
    fn build(&mut self) -> R<()> {
        let state = self.pop()?;
        let target = self.top()?;
        // torch sets attributes of state dicts (`_metadata`) and of tensors this
        // way; neither carries tensor data, so the state is dropped. An allow-listed
        // instance keeps its state: that is where dataclasses keep their fields.
        let idx = match target {
            V::Obj(i) => i,
            _ => usize::MAX,
        };
        // A legacy tensor gets its storage here: torch calls
        // `set_(storage, offset, size, stride)` with the state.
        if let Some(Obj::EmptyTensor(d)) = self.objs.get(idx) {
            let d = *d;
            let t = match self.items_of(state) {
                Some(&[storage, offset, size, stride]) => self.tensor_ref(storage, offset, size, stride, Some(d))?,
                _ => return self.bad("a legacy tensor's state must be (storage, offset, size, stride)"),
            };
            self.charge(tensor_bytes(&t))?;
            if let Some(slot) = self.objs.get_mut(idx) {
                *slot = Obj::Tensor(t);
            }
            return Ok(());
        }
        let dict_state = matches!(self.obj_at(state), Some(Obj::Dict(_)));
        let d = self.depth_of(state) + 1;
        if matches!(self.objs.get(idx), Some(Obj::Instance { state: None, .. })) {
            if d > self.limits.max_depth {
                return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
            }
            if let Some(slot) = self.depth.get_mut(idx) {
                *slot = (*slot).max(d);
            }
        }
        match self.objs.get_mut(idx) {
            Some(Obj::Dict(_) | Obj::Tensor(_)) => {}
            Some(Obj::Instance { state: slot @ None, .. }) => *slot = Some(state),
            // A TorchScript object's state is its attribute dict, unless its class
            // defines `__getstate__`; that state only its own code understands.
            Some(Obj::Script { state: slot @ None, .. }) if dict_state => *slot = Some(state),
            _ => return self.bad(format!("BUILD on {} is not allowed", self.describe(target))),
        }
        Ok(())
    }

    pub(super) fn long(&mut self, n: usize) -> R<()> {
        let bytes = self.taken(n)?.to_vec();
        if n <= 8 {
            let fill = if bytes.last().is_some_and(|&b| b & 0x80 != 0) { 0xff } else { 0 };
            let mut buf = [fill; 8];
            buf.get_mut(..n).unwrap_or_default().copy_from_slice(&bytes);
            self.push(V::Int(i64::from_le_bytes(buf)))
        } else {
            let v = self.alloc(Obj::BigInt(bytes))?;
            self.push(v)
        }
    }

    /// `APPEND`(S): the values from `start` up on the stack go to the list (or record of a list
    /// subclass) `target`, its buffer charged as it grows.
    pub(super) fn extend_list(&mut self, target: V, start: usize) -> R<()> {
        let added = self.stack.get(start..).unwrap_or_default();
        let d = added.iter().map(|&v| self.depth_of(v) + 1).max().unwrap_or(0);
        if d > self.limits.max_depth {
            return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
        }
        let n = added.len();
        if let V::Obj(i) = target {
            let budget = Rc::clone(&self.budget);
            let at = self.op_at;
            let Machine { objs, stack, depth, .. } = self;
            // A record of a list subclass gets its items the way a list does.
            let list = match objs.get_mut(i) {
                Some(Obj::List(list)) => Some(list),
                Some(Obj::Instance { items, .. }) => {
                    if items.is_none() {
                        budget.charge(alloc_bytes(size_of::<Items>())).map_err(|reason| Refusal::Bad { at, reason })?;
                    }
                    Some(&mut items.get_or_insert_with(Box::default).list)
                }
                _ => None,
            };
            if let Some(list) = list {
                budget.grow(list, n).map_err(|reason| Refusal::Bad { at, reason })?;
                list.extend(stack.drain(start..));
                if let Some(slot) = depth.get_mut(i) {
                    *slot = (*slot).max(d);
                }
                return Ok(());
            }
        }
        self.bad(format!("APPEND to {}", self.describe(target)))
    }

    /// `SETITEM`(S): the key-value pairs from `start` up on the stack go to the dict (or record
    /// of a dict subclass) `target`, its buffer charged as it grows.
    pub(super) fn extend_dict(&mut self, target: V, start: usize) -> R<()> {
        let added = self.stack.get(start..).unwrap_or_default();
        let d = added.iter().skip(1).step_by(2).map(|&v| self.depth_of(v) + 1).max().unwrap_or(0);
        if d > self.limits.max_depth {
            return self.bad(format!("nesting deeper than {} levels", self.limits.max_depth));
        }
        let n = added.len() / 2;
        if let V::Obj(i) = target {
            let budget = Rc::clone(&self.budget);
            let at = self.op_at;
            let Machine { objs, stack, depth, .. } = self;
            // A record of a dict subclass (`defaultdict`, an `AttributeDict`) likewise.
            let dict = match objs.get_mut(i) {
                Some(Obj::Dict(dict)) => Some(dict),
                Some(Obj::Instance { items, .. }) => {
                    if items.is_none() {
                        budget.charge(alloc_bytes(size_of::<Items>())).map_err(|reason| Refusal::Bad { at, reason })?;
                    }
                    Some(&mut items.get_or_insert_with(Box::default).dict)
                }
                _ => None,
            };
            if let Some(dict) = dict {
                budget.grow(dict, n).map_err(|reason| Refusal::Bad { at, reason })?;
                // Repeated keys are kept here and refused when names are flattened.
                let mut it = stack.drain(start..);
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    dict.push((k, v));
                }
                if let Some(slot) = depth.get_mut(i) {
                    *slot = (*slot).max(d);
                }
                return Ok(());
            }
        }
        self.bad(format!("SETITEM on {}", self.describe(target)))
    }
}
